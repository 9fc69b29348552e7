"""Window Pool's arms over seeds from perplexity grids (`scripts/window_pool_arms.sh` writes them): per arm and cell,
held-out perplexity relative to the base target's in the same cell, the mean over seeds with its seed-level t
interval and the per-seed values, the base's absolute perplexity beside it, and the issue's goal verdict per arm.

Usage: python scripts/window_pool_seeds.py GRID.json [GRID2.json ...] [--versus ARM] [--output TABLE.md]
Targets are labelled ARM_sSEED (the arms script's labels); `base` is the reference. Several grids (e.g. the three
arms' and the document-pool arms' from a second call) merge when they measured the same text (equal base
perplexities); a target in two grids counts once when its figures agree there. ``--versus ARM`` adds every other
arm's perplexity over ARM's, paired seed by seed (e.g. the control, or the document-pool base). Goal: better than the base in every constrained cell (the t interval's upper bound below
1) with the unconstrained perplexity at most +2 %.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

from vat.bench.stats import t_interval

LABEL = re.compile(r"^(?P<arm>.+)_s(?P<seed>\d+)$")
UNCONSTRAINED_LIMIT = 1.02  # the goal's allowance on the natural (unconstrained) perplexity


def _same_cells(a: dict, b: dict) -> bool:
    """Two grids' entries of one target agree: the same cells with perplexities equal to 1e-6 relative."""
    return set(a) == set(b) and all(abs(b[c]["ppl"] / a[c]["ppl"] - 1) <= 1e-6 for c in a)


def merge_grids(grids: list[dict]) -> dict:
    """One grid from several that measured the same text: their targets side by side (a label twice is refused)."""
    merged = {**grids[0], "results": dict(grids[0]["results"])}
    base = grids[0]["results"]["base"]
    for grid in grids[1:]:
        other = grid["results"]["base"]
        if not _same_cells(base, other):
            raise SystemExit("window_pool_seeds: the grids measured different text or cells (their base perplexities "
                             "differ); run them with the same --limit, --windows, --pools and --budgets")
        for label, cells in grid["results"].items():
            if label == "base":
                continue
            if label in merged["results"]:
                if _same_cells(merged["results"][label], cells):
                    continue  # the same target measured again (e.g. a rebuilt machine reproducing a control)
                raise SystemExit(f"window_pool_seeds: target {label} is in two grids with different perplexities")
            merged["results"][label] = cells
    return merged


def seed_ppl(grid: dict) -> dict[str, dict[str, dict[int, float]]]:
    """``{arm: {cell: {seed: ppl}}}`` for every ARM_sSEED target of the grid."""
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for label, cells in grid["results"].items():
        match = LABEL.match(label)
        if match is None:
            continue
        for cell, stats in cells.items():
            out[match["arm"]][cell][int(match["seed"])] = stats["ppl"]
    return out


def seed_ratios(grid: dict, versus: str | None = None) -> dict[str, dict[str, dict[int, float]]]:
    """``{arm: {cell: {seed: ppl / base ppl}}}`` for every ARM_sSEED target of the grid; with ``versus``, over that
    arm's perplexity at the same seed instead (only seeds both have; ``versus`` itself left out)."""
    ppl = seed_ppl(grid)
    base = grid["results"]["base"]
    if versus is not None and versus not in ppl:
        raise SystemExit(f"window_pool_seeds: no arm {versus} in the grid (arms: {', '.join(sorted(ppl))})")
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for arm, cells in ppl.items():
        if arm == versus:
            continue
        for cell, by_seed in cells.items():
            for seed, value in by_seed.items():
                if versus is None:
                    out[arm][cell][seed] = value / base[cell]["ppl"]
                elif seed in ppl[versus].get(cell, {}):
                    out[arm][cell][seed] = value / ppl[versus][cell][seed]
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


def _rows(cells: dict[str, dict[int, float]], base: dict) -> list[str]:
    """A table's rows: cell, the base's perplexity, mean ratio [t interval], per-seed ratios."""
    rows = []
    for cell, by_seed in cells.items():
        values = [by_seed[s] for s in sorted(by_seed)]
        est = t_interval(values)
        mean = sum(values) / len(values)
        interval = "" if est is None else f" [{est.low:.3f}, {est.high:.3f}]"
        rows.append(f"| {cell} | {base[cell]['ppl']:.2f} | {mean:.3f}{interval} | "
                    f"{' / '.join(f'{v:.3f}' for v in values)} |")
    return rows


def markdown(grid: dict, versus: str | None = None) -> str:
    """One table per arm: cell, base perplexity, mean ratio to base [t interval], per-seed ratios; then the verdict;
    with ``versus``, a second table per arm over that arm, paired by seed."""
    base = grid["results"]["base"]
    lines = []
    for arm, cells in sorted(seed_ratios(grid).items()):
        lines += [f"### {arm}", "", "| cell | base perplexity | perplexity / base [t 95 %] | per seed |",
                  "|---|---|---|---|", *_rows(cells, base), "", f"Goal: {verdict(cells)}.", ""]
    if versus is not None:
        for arm, cells in sorted(seed_ratios(grid, versus).items()):
            lines += [f"### {arm} / {versus}", "",
                      f"| cell | base perplexity | perplexity / {versus} [t 95 %] | per seed |", "|---|---|---|---|",
                      *_rows(cells, base), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grids", nargs="+", metavar="GRID.json")
    parser.add_argument("--versus", help="also each arm over this arm, paired by seed (e.g. wp_ctl, wp_doc)")
    parser.add_argument("--output")
    args = parser.parse_args()
    grids = []
    for path in args.grids:
        with open(path) as f:
            grids.append(json.load(f))
    text = markdown(merge_grids(grids), args.versus)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
