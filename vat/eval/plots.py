"""The three figures of an evaluation (matplotlib, Agg backend): τ per benchmark, acceptance by position, and the
expert-union vs τ trade-off across budgets."""

from __future__ import annotations

import os

import matplotlib
import matplotlib.pyplot as plt

from vat.eval.config import AR_LABEL, NO_BUDGET


def _pyplot():
    matplotlib.use("Agg")

    return plt


def _reference_budget(per_budget: dict) -> str:
    """The natural-routing pass when there is one, else the first budget evaluated."""
    return NO_BUDGET if NO_BUDGET in per_budget else next(iter(per_budget))


def _drafts(result: dict) -> list[str]:
    labels = [d for d in result["results"] if d != AR_LABEL]
    return labels or [AR_LABEL]


def plot_tau_by_benchmark(result: dict, path: str) -> str:
    """Grouped bars: τ (tokens per verification round) per benchmark, one bar per draft (natural routing)."""
    plt = _pyplot()
    benches = result["benchmarks"]
    drafts = _drafts(result)
    width = 0.8 / max(len(drafts), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(benches) + 2), 4))
    for i, draft in enumerate(drafts):
        per_budget = result["results"][draft]
        budget = _reference_budget(per_budget)
        taus = [(per_budget[budget].get(b) or {}).get("tau") or 0.0 for b in benches]
        xs = [j + (i - (len(drafts) - 1) / 2) * width for j in range(len(benches))]
        bars = ax.bar(xs, taus, width=width, label=f"{draft}" + ("" if budget == NO_BUDGET else f" (B={budget})"))
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="autoregressive (τ = 1)")
    ax.set_ylim(0, 1.25 * max([1.0] + [bar.get_height() for bar in ax.patches]))  # room for labels and legend
    ax.set_xticks(range(len(benches)), benches)
    ax.set_xlabel("benchmark")
    ax.set_ylabel("τ (tokens committed per verification round)")
    ax.set_title("Acceptance length per benchmark")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_accept_by_position(result: dict, path: str) -> str:
    """Lines: P(draft k accepted | position k reached) per draft (solid) and unconditional (dashed), all benchmarks."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for draft in _drafts(result):
        per_budget = result["pooled"].get(draft, {})
        if not per_budget:
            continue
        budget = _reference_budget(per_budget)
        acc = per_budget[budget]["accept_by_position"]
        ks = list(range(1, len(acc["conditional"]) + 1))
        if not ks:
            continue
        label = draft + ("" if budget == NO_BUDGET else f" (B={budget})")
        line = ax.plot(ks, [v or 0.0 for v in acc["conditional"]], marker="o", label=f"{label}: conditional")[0]
        ax.plot(ks, [v or 0.0 for v in acc["unconditional"]], marker="x", linestyle="--", color=line.get_color(),
                label=f"{label}: unconditional")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance rate (fraction of rounds)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (all benchmarks)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _quality_note(q: dict) -> str:
    """`` agree 97% KL 0.012``: the quality of a budgeted point (agreement is None when sampling)."""
    agree = "" if q.get("agreement") is None else f" agree {100 * q['agreement']:.0f}%"
    kl = "" if q.get("kl_to_natural") is None else f" KL {q['kl_to_natural']:.3g}"
    return agree + kl


def _plot_budget_fronts(series: dict[str, list[tuple]], path: str, xlabel: str, title: str) -> str:
    """One line per draft through its budgets, points ``(x, τ, budget, quality)`` sorted by x, each budgeted point
    labelled with its budget and quality (a budgeted τ is never shown without it); the autoregressive baseline as
    grey squares."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for draft, points in series.items():
        points = sorted(points, key=lambda p: p[0])
        if draft == AR_LABEL:
            ax.scatter([p[0] for p in points], [p[1] for p in points], marker="s", color="grey",
                       label="autoregressive")
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=draft)
        for x, y, b, q in points:
            if b == NO_BUDGET:
                continue
            note = f"B={b}" + ("" if not q else _quality_note(q))
            ax.annotate(note, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("τ (tokens committed per verification round)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_union_vs_tau(result: dict, path: str) -> str:
    """Pareto scatter: mean experts per MoE layer per verification round (x) vs τ (y), one line per draft through
    its budgets; the autoregressive baseline as a reference point."""
    series = {}
    for draft, per_budget in result["pooled"].items():
        points = [(m["union_per_round"]["mean"], m["tau"], b, m.get("quality")) for b, m in per_budget.items()
                  if m["union_per_round"]["mean"] is not None and m["tau"] is not None]
        if points:
            series[draft] = points
    return _plot_budget_fronts(series, path, "expert union (experts per MoE layer per verification round)",
                               "Expert union vs acceptance length across budgets")


def plot_mib_vs_tau(result: dict, path: str) -> str | None:
    """Pareto scatter on bytes: expert MiB read per generated token (x) vs τ (y), one line per draft through its
    budgets, each budgeted point labelled with its budget and quality; the autoregressive baseline as a reference.
    None when no pooled entry has expert bytes."""
    mib = 1024.0 ** 2
    series = {}
    for draft, per_budget in result["pooled"].items():
        points = [(m["expert_bytes_per_token"] / mib, m["tau"], b, m.get("quality")) for b, m in per_budget.items()
                  if m.get("expert_bytes_per_token") is not None and m.get("tau") is not None]
        if points:
            series[draft] = points
    if not series:
        return None
    return _plot_budget_fronts(series, path, "expert MiB read per generated token",
                               "Expert bytes per token vs acceptance length across budgets")


def plot_modeled_speedup(result: dict, path: str) -> str:
    """Grouped bars: the cost model's modeled speed-up over AR per benchmark, one bar per draft x budget
    (``--cost-model``; :mod:`vat.eval.cost`)."""
    plt = _pyplot()
    benches = result["benchmarks"]
    configs = [(d, b) for d, per in result["results"].items() if d != AR_LABEL for b in per]
    width = 0.8 / max(len(configs), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(benches) + 0.4 * len(configs) + 2), 4))
    for i, (draft, budget) in enumerate(configs):
        per_bench = result["results"][draft][budget]
        values = [((per_bench.get(b) or {}).get("cost") or {}).get("modeled_speedup_vs_ar") or 0.0 for b in benches]
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(benches))]
        bars = ax.bar(xs, values, width=width, label=draft + ("" if budget == NO_BUDGET else f" (B={budget})"))
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="autoregressive")
    ax.set_ylim(0, 1.25 * max([1.0] + [bar.get_height() for bar in ax.patches]))
    ax.set_xticks(range(len(benches)), benches)
    ax.set_xlabel("benchmark")
    ax.set_ylabel("modeled speed-up over AR")
    model = result["cost_model"]
    ax.set_title(f"Modeled speed-up on {model['label']} ({model['served_bytes']}-byte weights, bytes model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(result: dict, output: str) -> dict[str, str]:
    """Write the PNGs into ``output`` (the modeled speed-up too with a cost model); return ``{title: path}``."""
    figures = {
        "τ per benchmark": plot_tau_by_benchmark(result, os.path.join(output, "tau_by_benchmark.png")),
        "acceptance by position": plot_accept_by_position(result, os.path.join(output, "accept_by_position.png")),
        "expert union vs τ": plot_union_vs_tau(result, os.path.join(output, "union_vs_tau.png")),
    }
    mib = plot_mib_vs_tau(result, os.path.join(output, "mib_vs_tau.png"))
    if mib:
        figures["expert MiB per token vs τ"] = mib
    if result.get("cost_model"):
        figures["modeled speed-up over AR"] = plot_modeled_speedup(result, os.path.join(output, "modeled_speedup.png"))
    return figures
