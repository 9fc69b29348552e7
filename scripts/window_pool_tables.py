"""Print the Window Pool tables (docs/RESULTS.md) from a perplexity grid and two eval.json files.

Usage: python scripts/window_pool_tables.py GRID.json BASE_EVAL.json WP_EVAL.json [--draft-base LABEL --draft-wp LABEL]
The grid's Markdown comes from vat.window_pool.evaluate.markdown; the end-to-end table lists, per benchmark and
budget, tau, expert MiB per generated token, mean union per layer per round and agreement with the base target's
unbudgeted greedy output (eval.json `quality`; the Window Pool eval runs with `--reference-target BASE`, so its
natural-routing row is compared with the base too; an older one, without it, compares with its own output).
"""

from __future__ import annotations

import argparse
import json

from vat.window_pool.evaluate import markdown


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("grid")
    p.add_argument("base_eval", nargs="?")
    p.add_argument("wp_eval", nargs="?")
    p.add_argument("--draft-base", default=None)
    p.add_argument("--draft-wp", default=None)
    args = p.parse_args()
    print(markdown(json.load(open(args.grid))))
    if args.base_eval and args.wp_eval:
        print(e2e_table(json.load(open(args.base_eval)), json.load(open(args.wp_eval)), args.draft_base,
                        args.draft_wp))


if __name__ == "__main__":
    main()
