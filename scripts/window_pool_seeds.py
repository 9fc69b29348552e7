"""Window Pool's arms over seeds from one perplexity grid (`scripts/window_pool_arms.sh` writes it): per arm and cell,
held-out perplexity relative to the base target's in the same cell, the mean over seeds with its seed-level t
interval and the per-seed values, and the issue's goal verdict per arm.

Usage: python scripts/window_pool_seeds.py GRID.json [--output TABLE.md]
Targets are labelled ARM_sSEED (the arms script's labels); `base` is the reference. Goal: better than the base in
every constrained cell (the t interval's upper bound below 1) with the unconstrained perplexity at most +2 %.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

from vat.bench.stats import t_interval

LABEL = re.compile(r"^(?P<arm>.+)_s(?P<seed>\d+)$")
UNCONSTRAINED_LIMIT = 1.02  # the goal's allowance on the natural (unconstrained) perplexity


def seed_ratios(grid: dict) -> dict[str, dict[str, dict[int, float]]]:
    """``{arm: {cell: {seed: ppl / base ppl}}}`` for every ARM_sSEED target of the grid."""
    base = grid["results"]["base"]
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for label, cells in grid["results"].items():
        match = LABEL.match(label)
        if match is None:
            continue
        for cell, stats in cells.items():
            out[match["arm"]][cell][int(match["seed"])] = stats["ppl"] / base[cell]["ppl"]
    return out


def verdict(cells: dict[str, dict[int, float]]) -> str:
    """The goal on one arm: every constrained cell's upper t bound below 1, natural perplexity at most +2 %."""
    natural = cells.get("natural", {})
    natural_mean = sum(natural.values()) / len(natural) if natural else float("nan")
    intervals = [t_interval(list(v.values())) for cell, v in cells.items() if cell != "natural"]
    if any(est is None for est in intervals):
        return "not judged (fewer than 2 seeds)"
    beaten = sum(est.high < 1.0 for est in intervals)
    met = beaten == len(intervals) and natural_mean <= UNCONSTRAINED_LIMIT
    return (f"{'met' if met else 'not met'}: below the base in {beaten} of {len(intervals)} constrained cells, "
            f"unconstrained perplexity {100 * (natural_mean - 1):+.1f} %")


def markdown(grid: dict) -> str:
    """One table per arm: cell, mean ratio to base [t interval], per-seed ratios; then the verdict."""
    lines = []
    for arm, cells in sorted(seed_ratios(grid).items()):
        lines += [f"### {arm}", "", "| cell | perplexity / base [t 95 %] | per seed |", "|---|---|---|"]
        for cell, by_seed in cells.items():
            values = [by_seed[s] for s in sorted(by_seed)]
            est = t_interval(values)
            mean = sum(values) / len(values)
            interval = "" if est is None else f" [{est.low:.3f}, {est.high:.3f}]"
            lines.append(f"| {cell} | {mean:.3f}{interval} | {' / '.join(f'{v:.3f}' for v in values)} |")
        lines += ["", f"Goal: {verdict(cells)}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid")
    parser.add_argument("--output")
    args = parser.parse_args()
    with open(args.grid) as f:
        text = markdown(json.load(f))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
