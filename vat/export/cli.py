"""``vat export CKPT --format sglang|speculators|dflash --output DIR``: setup -> run -> report."""

from __future__ import annotations

import argparse
import os

from vat.errors import VatError


def export_draft(checkpoint: str, fmt: str, output: str, target: str | None = None) -> str:
    """Convert a draft directory (vat checkpoint, or another engine's export) to ``fmt`` in ``output``.

    Args:
        checkpoint: vat checkpoint directory (``output_dir/final``, ``checkpoints/step_N``), or an SGLang /
            speculators export.
        fmt: ``sglang`` or ``speculators`` (``dflash`` is not supported yet).
        output: output directory (must differ from ``checkpoint``).
        target: the target whose input embedding a speculators export ships; None = the draft's ``target_path``.

    Returns:
        ``output``.
    """
    from vat.export import export_sglang, export_speculators, load_draft

    if fmt == "dflash":
        raise VatError("export format 'dflash' is not yet supported")
    if fmt not in ("sglang", "speculators"):
        raise VatError(f"unknown export format {fmt!r} (choose from sglang, speculators)")
    if os.path.abspath(output) == os.path.abspath(checkpoint):
        raise VatError("--output must differ from the checkpoint directory")
    model, _ = load_draft(checkpoint)
    if fmt == "sglang":
        return export_sglang(model, output)
    return export_speculators(model, output, target=target)


def main(args: argparse.Namespace) -> int:
    """CLI entry: ``args.checkpoint``, ``args.format``, ``args.output``, ``args.target``."""
    out = export_draft(args.checkpoint, args.format, args.output, args.target)
    print(f"vat: wrote {args.format} EAGLE-3 draft to {out}")
    return 0
