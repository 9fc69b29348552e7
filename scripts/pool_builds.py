"""Pool one paired ratio over bench records of several target builds (vat.bench.pool).

Usage: python scripts/pool_builds.py --method dflash_vat --reference dflash_matched RECORD... [--output DIR]
Each RECORD is a `vat bench --record` folder (or a bench's run folder) holding cells/<method>/seedN and
cells/<reference>/seedN. Prints the Markdown table; with --output writes pooled.json and pooled.md there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vat.bench.pool import pool_ratio, pooled_markdown
from vat.errors import VatError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="bench record or run folders, one per target build")
    parser.add_argument("--method", required=True, help="the method label (numerator)")
    parser.add_argument("--reference", required=True, help="the reference label (denominator)")
    parser.add_argument("--output", help="write pooled.json and pooled.md here")
    parser.add_argument("--samples", type=int, default=2000, help="bootstrap replicates (default 2000)")
    args = parser.parse_args(argv)
    try:
        pooled = pool_ratio(args.records, args.method, args.reference, samples=args.samples)
    except VatError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = pooled_markdown(pooled, args.method, args.reference)
    print(table)
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "pooled.json"), "w") as f:
            json.dump({"method": args.method, "reference": args.reference, "records": args.records,
                       "benchmarks": pooled}, f, indent=1)
        with open(os.path.join(args.output, "pooled.md"), "w") as f:
            f.write(f"# {args.method} / {args.reference}, pooled over target builds\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
