"""The wheel carries every package of the source tree: setuptools installs only the packages pyproject lists (the
package directories are mapped, so nothing is discovered), and a package left out works in an editable install and is
missing from a regular one."""

import os

import tomllib
from conftest import REPO_ROOT


def test_every_package_directory_is_listed_in_pyproject():
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    source = {name: os.path.join(REPO_ROOT, path) for name, path in setuptools["package-dir"].items()}
    found = set()
    for name, root in source.items():
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(folder, root)
                found.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    assert found - listed == set(), "packages missing from [tool.setuptools] packages in pyproject.toml"
