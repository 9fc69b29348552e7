"""The wheel carries every package of the source tree: setuptools installs only the packages pyproject lists (the
package directories are mapped, so nothing is discovered), and a package left out works in an editable install and is
missing from a regular one."""

import os
import subprocess
import sys

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


def test_the_repository_root_shadows_no_installed_package():
    """Under ``python -m`` (and pytest's rootdir) the repository root leads sys.path, so a top-level package there
    hides an installed one of the same name: a top-level kernels/ hid Hugging Face's ``kernels``, which
    transformers >= 5.25 imports from transformers.activations, and every model import failed. Only ``vat`` and
    the recipes (installed as vat.recipes) may be packages at the root."""
    top_level = {d for d in os.listdir(REPO_ROOT) if os.path.isfile(os.path.join(REPO_ROOT, d, "__init__.py"))}
    assert top_level == {"vat", "recipes"}
    probe = (
        "import importlib.util, sys; import transformers.activations; "
        "spec = importlib.util.find_spec('kernels'); print(spec.origin if spec and spec.origin else '')"
    )
    # cwd = the repository root and -c: sys.path[0] is the root, as for `python -m vat` run there
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    origin = done.stdout.strip()  # kernels/__init__.py of whichever `kernels` imports (.venv may sit in the root)
    assert not origin or os.path.dirname(os.path.dirname(origin)) != REPO_ROOT
