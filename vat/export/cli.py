"""``vat export CKPT --format sglang|speculators|dflash --output DIR``: setup -> run -> report."""

from __future__ import annotations

import argparse
import os

from vat.drafters.dflash import DFlashDrafter
from vat.errors import VatError
from vat.export.checkpoint import load_draft
from vat.export.dflash import export_dflash
from vat.export.sglang import export_sglang
from vat.export.speculators import export_speculators


def export_draft(checkpoint: str, fmt: str, output: str, target: str | None = None) -> str:
    """Convert a draft directory (vat checkpoint, or another engine's export) to ``fmt`` in ``output``.

    Args:
        checkpoint: vat checkpoint directory (``output_dir/final``, ``checkpoints/step_N``), or an SGLang /
            speculators export.
        fmt: ``sglang`` or ``speculators`` for an EAGLE-3 draft, ``dflash`` (the DFlash release layout) for a DFlash
            draft.
        output: output directory (must differ from ``checkpoint``).
        target: the target whose input embedding a speculators export ships; None = the draft's ``target_path``.

    Returns:
        ``output``.
    """
    if fmt not in ("sglang", "speculators", "dflash"):
        raise VatError(f"unknown export format {fmt!r} (choose from sglang, speculators, dflash)")
    if os.path.abspath(output) == os.path.abspath(checkpoint):
        raise VatError("--output must differ from the checkpoint directory")
    model, _ = load_draft(checkpoint)
    if fmt == "dflash":
        return export_dflash(model, output)
    if isinstance(model, DFlashDrafter):
        raise VatError(f"{checkpoint} is a DFlash draft: export it with --format dflash (the layout SGLang and vLLM "
                       "load DFlash drafts from)")
    if fmt == "sglang":
        return export_sglang(model, output)
    return export_speculators(model, output, target=target)


def main(args: argparse.Namespace) -> int:
    """CLI entry: ``args.checkpoint``, ``args.format``, ``args.output``, ``args.target``."""
    out = export_draft(args.checkpoint, args.format, args.output, args.target)
    print(f"vat: wrote {args.format} {'DFlash' if args.format == 'dflash' else 'EAGLE-3'} draft to {out}")
    return 0
