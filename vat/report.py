"""The demo's report: training curves and the evaluation, EAGLE-3 vs EAGLE-3 + VAT side by side.

Reads what the stages wrote (each run's ``metrics.jsonl``, the eval.json dict) and writes ``DIR/report.md``,
``DIR/demo.json`` and ``DIR/training_tau_sim.png``; the evaluation's own PNGs are copied next to the report.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from vat.bench.stats import paired_ratio
from vat.eval.report import example_block


def _metrics(final_dir: str) -> list[dict]:
    path = os.path.join(os.path.dirname(final_dir), "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _mean_of_last(rows: list[dict], key: str, n: int = 10) -> float | None:
    values = [r[key] for r in rows[-n:] if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def training_table(finals: dict[str, str]) -> tuple[list[str], dict[str, dict]]:
    """Markdown rows comparing the training runs, and the numbers behind them."""
    lines = [
        "| draft | steps | objective (end) | τ_sim (start → end) | acc_0 (end) | union_sim (end) | VH AUC (end) | tokens/s | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for name, final in finals.items():
        rows = _metrics(final)
        if not rows:
            continue
        wall = None
        wall_file = os.path.join(final, "wall_seconds.json")
        if os.path.exists(wall_file):
            wall = json.load(open(wall_file))["train_seconds"]
        start_tau = _mean_of_last(rows[:10], "tau_sim")
        end = {k: _mean_of_last(rows, k) for k in ("loss", "tau_sim", "acc_0", "union_sim", "vh_auc", "tokens_per_s")}
        summary[name] = {"steps": rows[-1]["step"], "tau_sim_start": start_tau, **{f"{k}_end": v for k, v in end.items()},
                         "train_seconds": wall}
        lines.append(
            f"| {name} | {rows[-1]['step']} | {_fmt(end['loss'], 3)} | {_fmt(start_tau)} → {_fmt(end['tau_sim'])} | "
            f"{_fmt(end['acc_0'], 3)} | {_fmt(end['union_sim'])} | {_fmt(end['vh_auc'], 3)} | "
            f"{_fmt(end['tokens_per_s'], 0)} | {_fmt(wall / 60 if wall else None, 1)} min |"
        )
    return lines, summary


def plot_training(finals: dict[str, str], path: str) -> str | None:
    """τ_sim per training step for every draft (smoothed over 10 logged steps)."""
    matplotlib.use("Agg")

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for name, final in finals.items():
        rows = [r for r in _metrics(final) if r.get("tau_sim") is not None]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        taus = [r["tau_sim"] for r in rows]
        smooth = [sum(taus[max(0, i - 9):i + 1]) / len(taus[max(0, i - 9):i + 1]) for i in range(len(taus))]
        ax.plot(steps, smooth, label=name)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("training step")
    ax.set_ylabel("simulated acceptance length τ_sim (tokens / round)")
    ax.set_title("Training-time simulated acceptance length (10-step moving mean)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _label_names(results: dict) -> dict[str, str]:
    """eval label -> name in the report: the label the demo gave each draft, ``autoregressive`` for the baseline."""
    return {label: "autoregressive" if info.get("mode") == "ar" else label
            for label, info in results.get("drafts", {}).items()}


def _union_mib(m: dict) -> tuple[float | None, float | None]:
    """(mean expert union per layer per round, expert MiB read per generated token) of one eval cell."""
    union = (m.get("union_per_round") or {}).get("mean")
    mib = m["expert_bytes_per_token"] / 2**20 if m.get("expert_bytes_per_token") else None
    return union, mib


def ratio_pairs(results: dict) -> list[tuple[str, str]]:
    """(method, reference) pairs the headline gives τ ratios for: each trained draft over the first (the baseline),
    and each trained draft over the training-free n-gram draft."""
    modes = {label: info.get("mode") for label, info in results.get("drafts", {}).items()}
    trained = [label for label, mode in modes.items() if mode in ("chain", "tree", "block")]
    pairs = [(label, trained[0]) for label in trained[1:]]
    pairs += [(label, ref) for ref, mode in modes.items() if mode == "ngram" for label in trained]
    return pairs


def tau_ratio(results: dict, method: str, reference: str, budget: str, bench: str, samples: int = 2000) -> dict | None:
    """τ_method / τ_reference on one benchmark and budget with a 95 % paired-bootstrap interval over prompts
    (one seed: the prompts are the only resampled unit; ``vat bench`` adds seeds)."""
    per = results.get("per_prompt", {})
    rows = [per.get(label, {}).get(budget, {}).get(bench) for label in (method, reference)]
    if reference in per and budget not in per[reference] and "none" in per[reference]:
        rows[1] = per[reference]["none"].get(bench)  # a reference measured without budgets
    if not all(rows) or len(rows[0]) != len(rows[1]):
        return None
    # τ on delivered tokens (an eval.json older than `kept` counts falls back to accepted + 1)
    counts = [(np.array([[p.get("kept", p["committed"]) for p in r]]), np.array([[p["rounds"] for p in r]]))
              for r in rows]
    return paired_ratio(*counts[0], *counts[1], samples=samples).to_dict()


def _fmt_ratio(est: dict | None) -> str:
    if not est:
        return "–"
    return f"{est['value']:.2f} [{est['low']:.2f}, {est['high']:.2f}]"


def headline(results: dict) -> tuple[list[str], list[dict]]:
    """One row per benchmark and budget with every draft's τ, the τ ratios with their 95 % intervals, and the union
    per round and expert MiB per token side by side.

    Returns the Markdown lines and the same numbers as dicts (for ``demo.json``).
    """
    names = _label_names(results)
    per = results.get("results", {})
    budgets = [str(b) for b in results.get("settings", {}).get("budgets", [])]
    drafts = [(label, names[label]) for label in per if names.get(label) != "autoregressive"]
    pairs = ratio_pairs(results)
    heads = [f"τ {name}" for _, name in drafts] + [f"τ {m} / {r} [95 % CI]" for m, r in pairs]
    heads += [f"{what} {name}" for what in ("union/layer/round", "MiB/token") for _, name in drafts]
    lines = ["| benchmark | budget B | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    rows = []
    for bench in results.get("benchmarks", []):
        for budget in budgets:
            cells = {name: per[label].get(budget, {}).get(bench) for label, name in drafts}
            if not any(cells.values()):
                continue
            row = {"benchmark": bench, "budget": budget}
            for name, m in cells.items():
                union, mib = _union_mib(m or {})
                row[name] = {"tau": (m or {}).get("tau"), "union_per_round": union, "expert_mib_per_token": mib}
            row["ratios"] = {f"{m}/{r}": tau_ratio(results, m, r, budget, bench) for m, r in pairs}
            rows.append(row)
            values = [_fmt(row[n]["tau"]) for _, n in drafts] + [_fmt_ratio(v) for v in row["ratios"].values()]
            values += [_fmt(row[n]["union_per_round"]) for _, n in drafts]
            values += [_fmt(row[n]["expert_mib_per_token"], 3) for _, n in drafts]
            lines.append(f"| {bench} | {budget} | " + " | ".join(values) + " |")
    return lines, rows


def evaluation_tables(results: dict) -> list[str]:
    """τ, expert union per round, expert bytes per token and speed-up per benchmark, drafts side by side."""
    names = _label_names(results)
    per = results.get("results", {})
    budgets = [str(b) for b in results.get("settings", {}).get("budgets", [])]
    lines: list[str] = []
    for bench in results.get("benchmarks", []):
        lines += [f"### {bench}", "",
                  "| draft | budget B | τ | union / layer / round | expert MiB / token | tokens/s | speed-up vs AR |",
                  "|---|---|---|---|---|---|---|"]
        for label, per_budget in per.items():
            if names.get(label) == "autoregressive":
                continue
            for budget in budgets:
                m = per_budget.get(budget, {}).get(bench)
                if not m:
                    continue
                union, mib = _union_mib(m)
                lines.append(f"| {names.get(label, label)} | {budget} | {_fmt(m.get('tau'))} | {_fmt(union)} | "
                             f"{_fmt(mib, 3)} | {_fmt(m.get('tokens_per_s'), 1)} | {_fmt(m.get('speedup_vs_ar'))} |")
        ar_label = next((lb for lb, n in names.items() if n == "autoregressive"), None)
        ar = per.get(ar_label, {}).get("none", {}).get(bench) if ar_label else None
        if ar:
            union, mib = _union_mib(ar)
            lines.append(f"| autoregressive | none | 1.00 | {_fmt(union)} | {_fmt(mib, 3)} | "
                         f"{_fmt(ar.get('tokens_per_s'), 1)} | 1.00 |")
        lines.append("")
        # per category, every draft under every budget
        drafts = [(label, names[label]) for label in per if names.get(label) != "autoregressive"]
        columns = [(label, name, budget) for budget in budgets for label, name in drafts]
        cats: dict[str, dict[int, float]] = {}
        for i, (label, _, budget) in enumerate(columns):
            m = per[label].get(budget, {}).get(bench) or {}
            for cat, cm in (m.get("categories") or {}).items():
                cats.setdefault(cat, {})[i] = cm.get("tau")
        if len(cats) > 1:
            heads = [f"{name} ({'no budget' if budget == 'none' else f'B={budget}'})" for _, name, budget in columns]
            lines += [f"τ per category ({bench}):", "", "| category | " + " | ".join(heads) + " |",
                      "|---|" + "---|" * len(heads)]
            for cat, taus in cats.items():
                lines.append(f"| {cat} | " + " | ".join(_fmt(taus.get(i)) for i in range(len(columns))) + " |")
            lines.append("")
    return lines


def example_lines(results: dict) -> list[str]:
    """One decoded answer per benchmark (the eval's first prompt), so the τ tables are read beside what the drafts
    were predicting."""
    examples = results.get("examples", {})
    if not examples:
        return []
    lines = ["## What the target answered", ""]
    for name, example in examples.items():
        lines += [f"**{name}**", "", example_block(example), ""]
    return lines


def write_demo_report(out: str, finals: dict[str, str], results: dict, eval_dir: str, wall_seconds: float,
                      quick: bool = False) -> str:
    """Write ``out/report.md`` (+ demo.json, PNGs); returns the report path."""
    train_lines, train_summary = training_table(finals)
    head_lines, head_rows = headline(results)
    curve = plot_training(finals, os.path.join(out, "training_tau_sim.png"))
    pngs = []
    for name in sorted(os.listdir(eval_dir)) if os.path.isdir(eval_dir) else []:
        if name.endswith(".png"):
            shutil.copy(os.path.join(eval_dir, name), os.path.join(out, name))
            pngs.append(name)
    info = results.get("target_info", {})
    blocks = {label: d.get("block_size") for label, d in results.get("drafts", {}).items() if d.get("mode") == "block"}
    with_blocks = "".join(f", DFlash blocks of {size} for `{label}`" for label, size in blocks.items())
    lines = [
        f"# vat demo{' (quick)' if quick else ''}: EAGLE-3 vs EAGLE-3 + VAT{' vs DFlash + VAT' if blocks else ''} "
        "(and n-gram lookup) on the embedded tiny MoE target",
        "",
        f"Target: `{results.get('target')}` — OLMoE architecture, {info.get('num_experts')} experts, top-"
        f"{info.get('top_k')}, {len(info.get('moe_layer_ids', []))} MoE layers. Chain drafting K = "
        f"{results.get('settings', {}).get('steps')}{with_blocks}, greedy verification; budgets are per MoE layer per "
        "verification round (MoE-Spec, substitute policy). Wall time of the whole demo: "
        f"{wall_seconds / 60:.1f} min.",
        "",
        "## Headline: acceptance length τ, expert union per round and expert bytes per token",
        "",
        "Measured with real speculative decoding (the target verifies every drafted token); union = distinct experts "
        "per MoE layer per verification round; MiB/token = expert weights read per generated token. Ratios: τ of one "
        "draft over another's on the same prompts, with a 95 % paired-bootstrap interval over prompts; the demo trains "
        "one seed per draft, so the interval leaves out seed-to-seed variation: `vat bench recipes/bench/tiny.yaml` "
        "measures it (3 seeds). `ngram` is training-free prompt lookup (vLLM's n-gram speculator rule).",
        "",
        *head_lines,
        "",
        *example_lines(results),
        "## Training (same data, steps and seed)",
        "",
        *train_lines,
        "",
    ]
    if curve:
        lines += ["![τ_sim during training](training_tau_sim.png)", ""]
    lines += ["## Speculative decoding (measured, not simulated)", "", *evaluation_tables(results)]
    for name in pngs:
        lines += [f"![{name}]({name})", ""]
    lines += ["Full per-benchmark metrics: `eval/eval.json`; generations: `eval/generations.jsonl`.", ""]
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out, "demo.json"), "w") as f:
        json.dump({"wall_seconds": wall_seconds, "quick": quick, "headline": head_rows, "training": train_summary,
                   "drafts": {n: p for n, p in finals.items()}, "eval": os.path.join(eval_dir, "eval.json")}, f,
                  indent=2)
    return path
