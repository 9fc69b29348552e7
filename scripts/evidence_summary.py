"""The evidence tables of the bench-target benches, from their bench.json files (nothing is run).

    python scripts/evidence_summary.py runs/bench-tiny-bench-target [runs/bench-tiny-bench-ablation ...]

For each bench and benchmark (natural routing): τ per arm, the modeled H200 speed-up over AR, each trained arm's
paired ratio to the reference (``eagle3``) and to every ``compare`` arm (``eagle3_hard``), with the crossed bootstrap
interval, the seed-level t interval and the per-seed values, and its ratio to the best free draft of that benchmark
(named). Then the evidence issue's goals, judged on the metric each was set on (τ ratios; a win needs both lower
bounds above 1): VAT >= 1.10x EAGLE-3 and >= 1.05x EAGLE-3 + hard CE on both benchmarks; EAGLE-3 >= 1.2x and VAT >=
1.3x the best free draft. At temperature > 0 (the T = 1 bench) the goal is the issue's T = 1 one instead: a VAT recipe
at least level with EAGLE-3 (the ratio's interval reaches 1 or lies above it). A bench still running shows its
finished cells and says how many seeds each arm has.
"""

from __future__ import annotations

import json
import os
import sys

GOALS = [  # (method, against, at least): the evidence issue's goals on τ
    ("vat", "eagle3", 1.10),
    ("vat", "eagle3_hard", 1.05),
]
FREE_GOALS = [("eagle3", 1.2), ("vat", 1.3)]  # against the best free draft (the issue asks it at saturation)
SAMPLED_ARMS = ("vat", "vat_expected_t1")  # the VAT recipes the T = 1 goal is judged on, against the reference


def _interval(est: dict | None, digits: int = 3) -> str:
    if not est or est.get("value") is None:
        return "–"
    return f"{est['value']:.{digits}f} [{est['low']:.{digits}f}, {est['high']:.{digits}f}]"


def _ratio(est: dict | None) -> str:
    """A ratio cell: bootstrap, t interval and per-seed values where there are several seeds, **win** when both
    lower bounds exceed 1."""
    if not est or est.get("value") is None:
        return "–"
    text = _interval(est)
    t = est.get("t")
    if t and t.get("low") is not None:
        text += f", t [{t['low']:.3f}, {t['high']:.3f}]"
    seeds = est.get("per_seed") or {}
    if len(seeds) > 1:
        text += " (" + " / ".join(f"{v:.2f}" for v in seeds.values()) + ")"
    if est.get("win"):
        text += " **win**"
    return text


def _modeled(stats: dict) -> str:
    for key, value in stats.items():
        if key.startswith("modeled") and key.endswith("speedup") and isinstance(value, dict):
            return _interval(value)
    return "–"


def bench_tables(summary: dict) -> list[str]:
    """Markdown lines: one table per benchmark at natural routing."""
    reference, compare = summary["reference"], list(summary.get("compare") or [])
    lines = [f"### {summary['name']} ({summary['progress']['cells_done']} of {summary['progress']['cells_total']} "
             "cells)", ""]
    for bench in summary["benchmarks"]:
        best = (summary.get("best_free") or {}).get("none", {}).get(bench)
        results = {label: per["none"][bench] for label, per in summary["results"].items()
                   if bench in per.get("none", {})}
        lines += [f"#### {bench}", "",
                  f"| arm | seeds | τ [95 % CI] | modeled H200 speed-up over AR | / {reference} | "
                  + "".join(f"/ {c} | " for c in compare) + f"/ best free ({best or '–'}) |",
                  "|---|---|---|---|---|" + "---|" * len(compare) + "---|"]
        for label, stats in results.items():
            seeds = len(stats.get("seeds") or []) or "–"
            versus = stats.get("versus") or {}
            ratio = "1 (reference)" if label == reference else _ratio(stats.get("ratio"))
            lines.append(f"| {label} | {seeds} | {_interval(stats['tau'])} | {_modeled(stats)} | {ratio} | "
                         + "".join(f"{_ratio(versus.get(c)) if c != label else '–'} | " for c in compare)
                         + f"{_ratio(versus.get(best)) if best else '–'} |")
        lines.append("")
    return lines


def _met(est: dict | None, floor: float) -> str:
    if not est or est.get("value") is None:
        return "not measured"
    t = est.get("t") or {}
    both = est["low"] > 1 and (t.get("low") or 0) > 1
    if est["value"] >= floor and both:
        return "met"
    below = est["high"] < 1 and (t.get("high") if t.get("high") is not None else 0) < 1
    where = "both lower bounds > 1" if both else "both intervals below 1" if below else "an interval reaches 1"
    return f"not met ({est['value']:.3f}; {where})"


def _level(est: dict | None) -> str:
    """At least level: both intervals reach 1 or lie above it (their upper bounds >= 1)."""
    if not est or est.get("value") is None:
        return "not measured"
    t = est.get("t") or {}
    level = est["high"] >= 1 and (t.get("high") is None or t["high"] >= 1)
    return f"{'met' if level else 'not met'} ({est['value']:.3f} [{est['low']:.3f}, {est['high']:.3f}]" + (
        f", t [{t['low']:.3f}, {t['high']:.3f}])" if t.get("low") is not None else ")")


def sampled_goal_lines(summary: dict) -> list[str]:
    """The T = 1 goal: each VAT recipe at least level with the reference (EAGLE-3)."""
    lines = []
    for bench in summary["benchmarks"]:
        results = {label: per["none"][bench] for label, per in summary["results"].items()
                   if bench in per.get("none", {})}
        for method in SAMPLED_ARMS:
            if method in results and method != summary["reference"]:
                lines.append(f"- {bench}: {method} at least level with {summary['reference']} at T = "
                             f"{summary['settings']['eval']['temperature']:g}: {_level(results[method].get('ratio'))}")
    return lines


def goal_lines(summary: dict) -> list[str]:
    """The goals' verdicts for the arms this bench has."""
    if (summary.get("settings") or {}).get("eval", {}).get("temperature", 0.0) > 0:
        return sampled_goal_lines(summary)
    lines = []
    for bench in summary["benchmarks"]:
        best = (summary.get("best_free") or {}).get("none", {}).get(bench)
        results = {label: per["none"][bench] for label, per in summary["results"].items()
                   if bench in per.get("none", {})}
        for method, against, floor in GOALS:
            if method not in results or against not in results:
                continue
            est = results[method]["ratio"] if against == summary["reference"] else \
                (results[method].get("versus") or {}).get(against)
            lines.append(f"- {bench}: {method} >= {floor:.2f}x {against}: {_met(est, floor)}")
        for method, floor in FREE_GOALS:
            if method in results and best:
                est = (results[method].get("versus") or {}).get(best)
                lines.append(f"- {bench}: {method} >= {floor:.1f}x the best free draft ({best}): {_met(est, floor)}")
    return lines


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = []
    for path in argv:
        file = path if path.endswith(".json") else os.path.join(path, "bench.json")
        if not os.path.isfile(file):
            print(f"evidence_summary: {file}: no bench.json (has the bench written its first cell?)", file=sys.stderr)
            return 2
        with open(file) as f:
            summary = json.load(f)
        out += bench_tables(summary)
        goals = goal_lines(summary)
        if goals:
            out += ["Goals (τ ratios; met = at least the goal with both lower bounds above 1):", "", *goals, ""]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
