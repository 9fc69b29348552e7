"""Print the Window Pool tables (docs/RESULTS.md) from a perplexity grid and two eval.json files.

Usage: python scripts/window_pool_tables.py GRID.json BASE_EVAL.json WP_EVAL.json [--draft-base LABEL --draft-wp LABEL]
       python scripts/window_pool_tables.py --seeds BASE_EVAL.json ARM_sSEED=EVAL.json ... [--versus ARM]
The grid's Markdown comes from vat.window_pool.evaluate.markdown; the end-to-end table lists, per benchmark and
budget, tau, expert MiB per generated token, mean union per layer per round and agreement with the base target's
unbudgeted greedy output (eval.json `quality`; the Window Pool eval runs with `--reference-target BASE`, so its
natural-routing row is compared with the base too; an older one, without it, compares with its own output).
``--seeds`` takes one eval per arm and seed (the same draft on every target, each run with ``--reference-target``
the base) and prints, per benchmark and budget, each arm's mean over seeds with its seed-level t interval (τ, expert
MiB per token, agreement, stepwise agreement, KL to the base's natural output) and, with ``--versus``, every arm's τ
and MiB over that arm's paired seed by seed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict

from vat.bench.stats import t_interval
from vat.window_pool.evaluate import markdown

LABEL = re.compile(r"^(?P<arm>.+)_s(?P<seed>\d+)$")


def _load(path: str) -> dict:
    """An eval.json, or its gzip (the committed records keep them compressed)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def _draft(ev: dict, label: str | None) -> str:
    labels = [k for k in ev["results"] if k not in ("none", "ngram")]
    return label or labels[0]


def e2e_table(base: dict, wp: dict, base_label: str | None = None, wp_label: str | None = None) -> str:
    """Markdown: base vs Window Pool, per benchmark x budget."""
    rows = ["| benchmark | B | τ base | τ WP | MiB/token base | MiB/token WP | union base | union WP | "
            "agreement base | agreement WP |", "|---|---|---|---|---|---|---|---|---|---|"]
    rb, rw = base["results"][_draft(base, base_label)], wp["results"][_draft(wp, wp_label)]
    for budget in rb:
        for bench in rb[budget]:
            a, b = rb[budget][bench], rw.get(budget, {}).get(bench)
            if b is None:
                continue
            qa, qb = a.get("quality") or {}, b.get("quality") or {}
            agree = " | ".join(f"{q['agreement']:.1%}" if q.get("agreement") is not None else "—" for q in (qa, qb))
            rows.append(f"| {bench} | {budget} | {a['tau']:.2f} | {b['tau']:.2f} | "
                        f"{a['expert_bytes_per_token'] / 2**20:.2f} | {b['expert_bytes_per_token'] / 2**20:.2f} | "
                        f"{a['union_per_round']['mean']:.2f} | {b['union_per_round']['mean']:.2f} | {agree} |")
    return "\n".join(rows) + "\n"


def _figures(row: dict) -> dict[str, float]:
    """The per-row figures the seed table averages (agreement figures are missing without a quality reference)."""
    q = row.get("quality") or {}
    return {"tau": row["tau"], "mib": row["expert_bytes_per_token"] / 2**20, "agreement": q.get("agreement"),
            "stepwise": q.get("stepwise_agreement"), "kl": q.get("kl_to_natural")}


def _cell(values: list[float], fmt: str) -> str:
    """Mean [t 95 %] over seeds, or the one value."""
    est = t_interval(values)
    if est is None:
        return format(values[0], fmt) if values else "—"
    return f"{format(est.value, fmt)} [{format(est.low, fmt)}, {format(est.high, fmt)}]"


def seed_table(base: dict, evals: dict[str, dict], versus: str | None = None) -> str:
    """Markdown: per benchmark x budget, base and every arm over seeds; ``evals`` maps ARM_sSEED -> eval.json."""
    arms: dict[str, dict[int, dict]] = defaultdict(dict)
    for label, ev in evals.items():
        m = LABEL.match(label)
        if m is None:
            raise SystemExit(f"label {label!r} is not ARM_sSEED (e.g. wp_ctl_s0)")
        arms[m["arm"]][int(m["seed"])] = ev["results"][_draft(ev, None)]
    ref = base["results"][_draft(base, None)]
    head = "| benchmark | B | arm | seeds | τ | MiB/token | agreement | stepwise agreement | KL to base natural |"
    extra = f" τ / {versus} (per seed) | MiB / {versus} |" if versus else ""
    rows = [head + extra, "|" + "---|" * (9 + (2 if versus else 0))]
    for budget in ref:
        for bench in ref[budget]:
            groups = {"base": {0: ref[budget][bench]}} | {
                a: {s: r[budget][bench] for s, r in by_seed.items() if bench in r.get(budget, {})}
                for a, by_seed in arms.items()}
            for arm, by_seed in groups.items():
                f = [_figures(by_seed[s]) for s in sorted(by_seed)]
                col = lambda k, fmt, f=f: _cell([x[k] for x in f if x[k] is not None], fmt)  # noqa: E731
                line = (f"| {bench} | {budget} | {arm} | {len(f)} | {col('tau', '.3f')} | {col('mib', '.2f')} | "
                        f"{col('agreement', '.1%')} | {col('stepwise', '.1%')} | {col('kl', '.4f')} |")
                if versus:
                    pair = sorted(set(by_seed) & set(groups.get(versus, {}))) if arm not in ("base", versus) else []
                    ratio = {k: [_figures(by_seed[s])[k] / _figures(groups[versus][s])[k] for s in pair]
                             for k in ("tau", "mib")}
                    seeds = " / ".join(f"{v:.3f}" for v in ratio["tau"])
                    line += (f" {_cell(ratio['tau'], '.3f')} ({seeds}) | {_cell(ratio['mib'], '.3f')} |" if pair
                             else " – | – |")
                rows.append(line)
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", action="store_true", help="BASE_EVAL ARM_sSEED=EVAL ...: the arms over seeds")
    p.add_argument("--versus", default=None, help="with --seeds: each arm's τ and MiB over this arm's, by seed")
    p.add_argument("grid")
    p.add_argument("base_eval", nargs="?")
    p.add_argument("wp_eval", nargs="?")
    p.add_argument("--draft-base", default=None)
    p.add_argument("--draft-wp", default=None)
    args, rest = p.parse_known_args()
    if args.seeds:
        pairs = [args.base_eval, args.wp_eval, *rest] if args.wp_eval else rest
        evals = {k: _load(v) for k, v in (x.split("=", 1) for x in pairs if x)}
        print(seed_table(_load(args.grid), evals, args.versus))
        return
    print(markdown(_load(args.grid)))
    if args.base_eval and args.wp_eval:
        print(e2e_table(_load(args.base_eval), _load(args.wp_eval), args.draft_base,
                        args.draft_wp))


if __name__ == "__main__":
    main()
