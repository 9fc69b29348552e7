"""``vat export CKPT --format sglang|speculators|dflash --output DIR``: setup -> run -> report."""

from __future__ import annotations

import argparse
import os

from vat.errors import VatError


def export_draft(checkpoint: str, fmt: str, output: str) -> str:
    """Convert a draft directory (vat checkpoint, or another engine's export) to ``fmt`` in ``output``.

    Args:
        checkpoint: vat checkpoint directory (``output_dir/final``, ``checkpoints/step_N``), or an SGLang /
            speculators export.
        fmt: ``sglang`` or ``speculators`` (``dflash`` is not supported yet).
        output: output directory (must differ from ``checkpoint``).

    Returns:
        ``output``.
    """
    from vat.export.checkpoint import load_draft
    from vat.export.sglang import export_sglang
    from vat.export.speculators import export_speculators

    writers = {"sglang": export_sglang, "speculators": export_speculators}
    if fmt == "dflash":
        raise VatError("export format 'dflash' is not yet supported")
    if fmt not in writers:
        raise VatError(f"unknown export format {fmt!r} (choose from {', '.join(writers)})")
    if os.path.abspath(output) == os.path.abspath(checkpoint):
        raise VatError("--output must differ from the checkpoint directory")
    model, _ = load_draft(checkpoint)
    return writers[fmt](model, output)


def main(args: argparse.Namespace) -> int:
    """CLI entry: ``args.checkpoint``, ``args.format``, ``args.output``."""
    out = export_draft(args.checkpoint, args.format, args.output)
    print(f"vat: wrote {args.format} EAGLE-3 draft to {out}")
    return 0
