"""YAML recipes, ``<target>/<drafter>_<method>.yaml``, installed as package data of ``vat.recipes``.

They stay at the repository's top level so a clone runs ``vat train recipes/tiny/eagle3.yaml``; pyproject maps this
folder to ``vat.recipes`` so a wheel carries them too. Find them with ``vat.paths.recipe_path("tiny/eagle3.yaml")``.
"""
