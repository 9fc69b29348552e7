"""The bench's figures (matplotlib, Agg backend): τ per benchmark with interval error bars for every method side by
side, τ against training tokens per method (mean over seeds with the seed range), and the Pareto plot of τ against
expert MiB per generated token (every method x budget, agreement beside each budgeted point)."""

from __future__ import annotations

import io
import os

import matplotlib
import matplotlib.pyplot as plt
from PIL import Image

from vat.bench.summary import GOAL_BYTES, GOAL_TAU, NO_BUDGET, free_tau

PNG_DPI = 100  # the bench PNGs are records kept in the repository: legible, and optimized to stay small


def save_png(fig, path: str) -> None:
    """``fig`` as a 256-colour palette PNG (a plot has few colours: the same picture at about a third of the bytes)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=PNG_DPI, bbox_inches="tight")  # a long title or legend is never clipped
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256, method=0).save(path, optimize=True)  # 0: median cut


def _pyplot():
    matplotlib.use("Agg")

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
    ax.set_ylim(0, (1.2 if len(labels) <= 2 else 1.45) * top)  # room for a two-column legend above the bars
    ax.set_xticks(range(len(benches)), benches)
    ax.set_xlabel("benchmark")
    ax.set_ylabel("τ (tokens committed per verification round)")
    suffix = "" if budget == NO_BUDGET else f", expert budget B = {budget}"
    ax.set_title(f"Acceptance length, {conf} % bootstrap intervals{suffix}")
    ax.legend(fontsize=8, loc="upper left", ncols=min(len(labels), 2))
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return path


def _draw_curves(ax, curves: dict[str, list[tuple[float, float, float, float]]], title: str) -> None:
    """One line per method over (tokens, mean, min, max) points, the seed range as a band, on a labelled axis."""
    for label, points in curves.items():
        if not points:
            continue
        xs, means, lows, highs = zip(*points)
        line, = ax.plot(xs, means, marker="o", label=label)
        ax.fill_between(xs, lows, highs, alpha=0.2, color=line.get_color(), linewidth=0)
    ax.set_title(title)
    ax.set_xlabel("training tokens per draft")
    ax.set_ylabel("τ (tokens per verification round)")
    ax.grid(alpha=0.3)


def _save_figure(plt, fig, axes, path: str) -> str:
    """Legends on ``axes``, then the figure as the bench's palette PNG at ``path``; returns ``path``."""
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return path


def plot_tau_vs_tokens(summary: dict, path: str) -> str | None:
    """τ against training tokens per method: mean over seeds (line) and the seed range (band); None without a curve."""
    curve = summary.get("curve") or {}
    if not curve:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    _draw_curves(ax, {label: [(p["tokens"], p["tau_mean"], p["tau_min"], p["tau_max"])
                              for p in points if p["tau_mean"] is not None] for label, points in curve.items()},
                 "τ against training tokens (mean over seeds, band = seed range)")
    return _save_figure(plt, fig, [ax], path)


def plot_curve_by_benchmark(summary: dict, path: str) -> str | None:
    """One panel per benchmark: τ against training tokens per method (mean over seeds, band = seed range) with the
    best free draft's τ as a dashed line when the curve ran on its prompts, to see where a trained draft passes it;
    None without a curve."""
    curve = summary.get("curve") or {}
    benches = [b for b in summary["benchmarks"]
               if any(b in p.get("per_benchmark", {}) for points in curve.values() for p in points)]
    if not benches:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        _draw_curves(ax, {label: [(p["tokens"], *(p["per_benchmark"][bench][k] for k in ("mean", "min", "max")))
                                  for p in points if bench in p.get("per_benchmark", {})]
                          for label, points in curve.items()}, bench)
        free = free_tau(summary, bench) if summary.get("curve_on_eval_prompts") else None
        if free is not None:
            ax.axhline(free[1], color="black", linestyle="--", linewidth=1, label=f"best free: {free[0]}")
    return _save_figure(plt, fig, list(axes[0]), path)


def pareto_points(summary: dict, bench: str) -> list[dict]:
    """Every (method or baseline) x budget evaluated on ``bench`` with expert MiB per generated token:
    ``{label, budget, mib, mib_low, mib_high, tau, tau_low, tau_high, agreement, stepwise_agreement}`` (the
    agreements None without a budget or without quality figures)."""
    points = []
    for label in summary["methods"] + summary["baselines"]:
        for budget in summary["budgets"]:
            stats = summary["results"].get(label, {}).get(budget, {}).get(bench)
            if not stats or stats["tau"]["value"] is None or not stats.get("expert_mib_per_token"):
                continue
            mib, tau = stats["expert_mib_per_token"], stats["tau"]
            if mib["value"] is None:
                continue
            quality = stats.get("quality") or {}
            points.append({"label": label, "budget": budget, "mib": mib["value"], "mib_low": mib["low"],
                           "mib_high": mib["high"], "tau": tau["value"], "tau_low": tau["low"], "tau_high": tau["high"],
                           "agreement": quality.get("agreement") if budget != NO_BUDGET else None,
                           "stepwise_agreement": quality.get("stepwise_agreement") if budget != NO_BUDGET else None})
    return points


def _drafted_by(summary: dict) -> dict[str, str]:
    """Methods that evaluate another method's drafts (``draft: "{bench_dir}/cells/<method>/..."``, e.g. eagle3 under
    budgets as ``eagle3_at_budget``) -> that method: the plot draws them in its colour, as the same drafts."""
    methods = summary["settings"].get("methods", {}) if summary.get("settings") else {}
    out = {}
    for label, method in methods.items():
        parts = str((method or {}).get("draft") or "").split("/")
        if len(parts) > 2 and parts[0] == "{bench_dir}" and parts[1] == "cells" and parts[2] in summary["methods"]:
            if parts[2] != label:
                out[label] = parts[2]
    return out


def plot_pareto_bytes(summary: dict, path: str) -> str | None:
    """τ against expert MiB per generated token, one panel per benchmark: one point per method x budget (colour =
    method, a method evaluating another's drafts in that one's colour; marker = budget, error bars = the bootstrap
    intervals of both), each budgeted point labelled with its budget and its agreement with the unbudgeted greedy
    output (and its stepwise agreement); dotted guides at the goal (<= 0.70x the reference's natural MiB per token,
    >= 0.98x its τ); a dashed line through the front (``summary["front"]``: no point reads fewer bytes at a higher
    τ). None when no cell has expert bytes yet.
    """
    benches = [b for b in summary["benchmarks"] if pareto_points(summary, b)]
    if not benches:
        return None
    plt = _pyplot()
    conf = round(100 * summary["interval"]["confidence"])
    labels = summary["methods"] + summary["baselines"]
    drafted_by = _drafted_by(summary)
    own = [label for label in labels if label not in drafted_by]
    colors = {label: f"C{i % 10}" for i, label in enumerate(own)}
    colors.update({label: colors[maker] for label, maker in drafted_by.items()})
    markers = {budget: "osD^v<>ph*"[i % 10] for i, budget in enumerate(summary["budgets"])}
    fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4.5), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        points = pareto_points(summary, bench)
        for p in points:
            xerr = [[max(p["mib"] - p["mib_low"], 0.0)], [max(p["mib_high"] - p["mib"], 0.0)]]
            yerr = [[max(p["tau"] - p["tau_low"], 0.0)], [max(p["tau_high"] - p["tau"], 0.0)]]
            ax.errorbar(p["mib"], p["tau"], xerr=xerr, yerr=yerr,
                        fmt=markers[p["budget"]], color=colors[p["label"]], capsize=2, markersize=6, linewidth=0.8)
            if p["budget"] != NO_BUDGET:
                agree = "agreement n/a" if p["agreement"] is None else f"{100 * p['agreement']:.1f} %"
                if p["stepwise_agreement"] is not None:
                    agree += f" (stepwise {100 * p['stepwise_agreement']:.1f} %)"
                ax.annotate(f"B={p['budget']}: {agree}", (p["mib"], p["tau"]), textcoords="offset points",
                            xytext=(5, 4), fontsize=7, color=colors[p["label"]])
        front = [p for p in (summary.get("front") or {}).get(bench, []) if p["front"]]  # sorted by MiB per token
        if len(front) > 1:
            ax.plot([p["mib_per_token"] for p in front], [p["tau"] for p in front], color="black", linestyle="--",
                    linewidth=0.7, zorder=0)
        ref = next((p for p in points if p["label"] == summary["reference"] and p["budget"] == NO_BUDGET), None)
        if ref is not None:
            ax.axvline(GOAL_BYTES * ref["mib"], color="grey", linestyle=":", linewidth=1)
            ax.axhline(GOAL_TAU * ref["tau"], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("expert MiB per generated token")
        ax.set_ylabel("τ (tokens committed per verification round)")
        ax.set_title(bench)
        ax.grid(alpha=0.3)
    shown = {p["label"] for b in benches for p in pareto_points(summary, b)}
    handles = [plt.Line2D([], [], color=colors[label], marker="o", linestyle="",
                          label=" / ".join([label, *[d for d, m in drafted_by.items() if m == label and d in shown]]))
               for label in own if label in shown or any(m == label and d in shown for d, m in drafted_by.items())]
    handles += [plt.Line2D([], [], color="black", marker=markers[b], linestyle="",
                           label="natural routing" if b == NO_BUDGET else f"B = {b}") for b in summary["budgets"]]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="best")
    goal = f"guides: {GOAL_BYTES:.2f}x {summary['reference']}'s natural MiB/token, {GOAL_TAU:.2f}x its τ"
    fig.suptitle(f"τ against expert bytes per token, {conf} % bootstrap intervals ({goal})", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return path


def write_plots(summary: dict, out: str) -> list[str]:
    """``tau_by_benchmark.png`` (``tau_by_benchmark_B<b>.png`` per budget), ``tau_vs_tokens.png``,
    ``tau_vs_tokens_by_benchmark.png`` (with the best free draft) and ``pareto_mib.png`` (τ against expert MiB per
    generated token, every method x budget)."""
    written = []
    for budget in summary["budgets"]:
        name = "tau_by_benchmark.png" if budget == NO_BUDGET else f"tau_by_benchmark_B{budget}.png"
        written.append(plot_tau_intervals(summary, budget, os.path.join(out, name)))
    written.append(plot_tau_vs_tokens(summary, os.path.join(out, "tau_vs_tokens.png")))
    written.append(plot_curve_by_benchmark(summary, os.path.join(out, "tau_vs_tokens_by_benchmark.png")))
    written.append(plot_pareto_bytes(summary, os.path.join(out, "pareto_mib.png")))
    return [p for p in written if p]
