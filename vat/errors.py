"""User-facing errors: raised for bad input, printed by the CLI as one clear line."""

import os


class VatError(Exception):
    """An error caused by the user's input (missing file, unknown key, mismatched draft ...).

    The CLI prints ``vat: error: <message>`` and exits with status 2, without a traceback.
    """


def require_file(path: str, what: str = "file") -> str:
    """Return ``path`` if it exists, else raise a one-line :class:`VatError` naming it."""
    if not os.path.exists(path):
        raise VatError(f"{what} not found: {path}")
    return path
