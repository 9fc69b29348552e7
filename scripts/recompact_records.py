"""Rewrite committed bench records' eval.json files in the current column layout (vat.bench.record), in place.

A record made before nested dicts became nested columns keeps, e.g., the offload counts as one dict per prompt; this
rewrites it without changing a count beyond the 12 significant digits a record keeps of a float: each file's
per-prompt counts are read back and compared before it is replaced.

    python scripts/recompact_records.py docs/bench            # every record under docs/bench
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

from vat.bench.record import COLUMNS_KEY, compact_eval, per_prompt


def _same_counts(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_counts(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_counts(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-11, abs_tol=0.0)
    return a == b


def recompact(path: str) -> tuple[int, int]:
    """Rewrite one record eval.json; returns (bytes before, bytes after). Raises if a count would change."""
    with open(path) as f:
        before = json.load(f)
    after = compact_eval(before)
    if not _same_counts(per_prompt(json.loads(json.dumps(after))), per_prompt(before)):
        raise ValueError(f"{path}: a per-prompt count would change")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(after, f, separators=(",", ":"))
    size_before = os.path.getsize(path)
    os.replace(tmp, path)
    return size_before, os.path.getsize(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="folder holding records (searched recursively for eval.json)")
    args = parser.parse_args(argv)
    total_before = total_after = count = 0
    for path in sorted(glob.glob(os.path.join(args.root, "**", "eval.json"), recursive=True)):
        with open(path) as f:
            if COLUMNS_KEY not in json.load(f):
                continue  # a full eval.json, not a record's
        before, after = recompact(path)
        total_before, total_after, count = total_before + before, total_after + after, count + 1
    print(f"{count} record eval.json files: {total_before / 1e6:.2f} MB -> {total_after / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
