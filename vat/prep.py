"""`vat prep` steps that need the layers above data preparation: the tiny target's build followed by its quality
report (greedy decodes through the eval engine), for ``vat prep tiny-target``."""

from __future__ import annotations

import argparse
import logging
import os

from vat.data_prep.tiny_target import build_tiny_target, format_report, read_report
from vat.eval.target_quality import write_quality
from vat.paths import tiny_seed, tiny_target_dir


def tiny_target_main(args: argparse.Namespace) -> int:
    """`vat prep tiny-target [--size full|quick|bench] [--output DIR] [--seed N] [--force] [--smoke] [--quality]`."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    size = "quick" if args.quick else args.size
    output_dir = args.output or tiny_target_dir(size)
    seed = tiny_seed() if args.seed is None else args.seed
    cached = not args.force and read_report(output_dir) is not None
    report = build_tiny_target(output_dir, size=size, seed=seed, force=args.force, smoke=args.smoke)
    if cached:
        print("(cached build; pass --force to rebuild)")
    print(format_report(report, os.path.abspath(output_dir)))
    if args.quality or (size == "bench" and not args.smoke):
        print(write_quality(output_dir, output_dir))
    return 0
