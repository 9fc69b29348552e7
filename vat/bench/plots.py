"""The bench's figures (matplotlib, Agg backend): τ per benchmark with interval error bars for every method side by
side, and τ against training tokens per method (mean over seeds with the seed range)."""

from __future__ import annotations

import os

NO_BUDGET = "none"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tau_intervals(summary: dict, budget: str, path: str) -> str | None:
    """Grouped bars: τ per benchmark for each method and baseline, error bars = the bootstrap interval.

    Returns:
        ``path``, or None when nothing was evaluated under ``budget`` yet.
    """
    labels = [x for x in summary["methods"] + summary["baselines"]
              if any(summary["results"].get(x, {}).get(budget, {}).get(b) for b in summary["benchmarks"])]
    benches = summary["benchmarks"]
    if not labels or not benches:
        return None
    plt = _pyplot()
    conf = round(100 * summary["interval"]["confidence"])
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(benches) + 2), 4))
    top = 1.0
    for i, label in enumerate(labels):
        xs, taus, errs = [], [], [[], []]
        for j, bench in enumerate(benches):
            stats = summary["results"].get(label, {}).get(budget, {}).get(bench)
            if not stats or stats["tau"]["value"] is None:
                continue
            t = stats["tau"]
            xs.append(j + (i - (len(labels) - 1) / 2) * width)
            taus.append(t["value"])
            errs[0].append(max(t["value"] - t["low"], 0.0))
            errs[1].append(max(t["high"] - t["value"], 0.0))
            top = max(top, t["high"])
        seeds = max(len(s["seeds"]) for s in summary["results"][label][budget].values())
        name = f"{label} ({seeds} seeds)" if seeds else label
        ax.bar(xs, taus, width=width, yerr=errs, capsize=3, label=name)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_ylim(0, 1.2 * top)
    ax.set_xticks(range(len(benches)), benches)
    ax.set_xlabel("benchmark")
    ax.set_ylabel("τ (tokens committed per verification round)")
    suffix = "" if budget == NO_BUDGET else f", expert budget B = {budget}"
    ax.set_title(f"Acceptance length, {conf} % bootstrap intervals{suffix}")
    ax.legend(fontsize=8, loc="upper left", ncols=min(len(labels), 4))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tau_vs_tokens(summary: dict, path: str) -> str | None:
    """τ against training tokens per method: mean over seeds (line) and the seed range (band); None without a curve."""
    curve = summary.get("curve") or {}
    if not curve:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in curve.items():
        points = [p for p in points if p["tau_mean"] is not None]
        if not points:
            continue
        xs = [p["tokens"] for p in points]
        line, = ax.plot(xs, [p["tau_mean"] for p in points], marker="o", label=label)
        ax.fill_between(xs, [p["tau_min"] for p in points], [p["tau_max"] for p in points], alpha=0.2,
                        color=line.get_color(), linewidth=0)
    ax.set_xlabel("training tokens per draft")
    ax.set_ylabel("τ (tokens per verification round)")
    ax.set_title("τ against training tokens (mean over seeds, band = seed range)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(summary: dict, out: str) -> list[str]:
    """``tau_by_benchmark.png`` (``tau_by_benchmark_B<b>.png`` per budget) and ``tau_vs_tokens.png``."""
    written = []
    for budget in summary["budgets"]:
        name = "tau_by_benchmark.png" if budget == NO_BUDGET else f"tau_by_benchmark_B{budget}.png"
        written.append(plot_tau_intervals(summary, budget, os.path.join(out, name)))
    written.append(plot_tau_vs_tokens(summary, os.path.join(out, "tau_vs_tokens.png")))
    return [p for p in written if p]
