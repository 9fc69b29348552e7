"""A bench under expert offloading: per resident-cache size C, the H2D traffic and the modeled speed-up of every cell.

The counts come from the evaluation (``eval.offload``, :mod:`vat.eval.offload`): per prompt and C, the H2D bytes the
decode moved, its cache hits and executed experts, the same for its autoregressive baseline (the same kept tokens, one
forward each) and both modeled times under offload. Like τ, every figure is a ratio of sums pooled over seeds and
prompts, with the crossed bootstrap, and a cell is paired with the reference (seed by seed, prompt by prompt) on H2D
bytes per delivered token and on the modeled speed-up under offload.
"""

from __future__ import annotations

import numpy as np

from vat.bench.stats import bootstrap_tau, ratio_record
from vat.bench.text import fmt_estimate, ratio_cell
from vat.eval.offload import OFFLOAD_COUNTS

COUNTS = (*OFFLOAD_COUNTS, "modeled_seconds", "modeled_ar_seconds")  # per prompt and C, under offload
MIB = 1024.0 * 1024.0


def collect_offload(entry: dict, prompts: list[dict]) -> None:
    """Append one cell's per-prompt offload counts to ``entry["offload"]`` (``{C: {count: [row per seed]}}``); a C
    some prompt lacks is skipped (:func:`finish_offload` then drops it: every seed must have it)."""
    sizes = set.intersection(*(set(p.get("offload") or {}) for p in prompts)) if prompts else set()
    store = entry.setdefault("offload", {})
    for size in sorted(sizes, key=int):
        per_count = store.setdefault(size, {k: [] for k in COUNTS})
        for key in COUNTS:
            per_count[key].append([float(p["offload"][size][key]) for p in prompts])


def finish_offload(entry: dict) -> None:
    """Turn the collected rows into (S, P) arrays, keeping only the C that every seed of the entry was priced at."""
    seeds = len(entry["seeds"])
    entry["offload"] = {size: {k: np.asarray(v, dtype=np.float64) for k, v in counts.items()}
                        for size, counts in (entry.get("offload") or {}).items()
                        if all(len(v) == seeds for v in counts.values())}


def _pick(entry: dict, size: str, keys: tuple[str, str], seeds: list | None) -> tuple[np.ndarray, np.ndarray]:
    """Two offload count arrays of ``entry`` at C = ``size``, rows for ``seeds`` (a baseline's only row: all)."""
    counts = entry["offload"][size]
    if seeds is None or entry["seeds"] == [None]:
        return counts[keys[0]], counts[keys[1]]
    index = [entry["seeds"].index(s) for s in seeds]
    return counts[keys[0]][index], counts[keys[1]][index]


def offload_statistics(entry: dict, kw: dict) -> dict[str, dict]:
    """Per C: ``h2d_mib_per_token`` (Σ H2D / Σ delivered tokens, bootstrap), ``per_seed_h2d_mib_per_token``,
    ``hit_rate`` (Σ hits / Σ executed), ``ar_h2d_mib_per_token`` and ``ar_hit_rate`` (the autoregressive baseline
    of the same prompts and tokens) and ``modeled_speedup`` (Σ modeled AR seconds / Σ modeled seconds, both under
    offload, bootstrap). ``{}`` when the cell was not priced under offload."""
    out = {}
    for size, counts in (entry.get("offload") or {}).items():
        kept = entry["kept"]  # (S, P) delivered tokens
        per_seed = counts["h2d_bytes"].sum(1) / np.maximum(kept.sum(1), 1) / MIB
        out[size] = {
            "h2d_mib_per_token": bootstrap_tau(counts["h2d_bytes"] / MIB, kept, **kw).to_dict(),
            "per_seed_h2d_mib_per_token": {str(s): float(v) for s, v in zip(entry["seeds"], per_seed)},
            "hit_rate": float(counts["hits"].sum() / max(counts["executed"].sum(), 1.0)),
            "ar_h2d_mib_per_token": float(counts["ar_h2d_bytes"].sum() / max(kept.sum(), 1.0) / MIB),
            "ar_hit_rate": float(counts["ar_hits"].sum() / max(counts["ar_executed"].sum(), 1.0)),
            "modeled_speedup": bootstrap_tau(counts["modeled_ar_seconds"], counts["modeled_seconds"], **kw).to_dict(),
        }
    return out


def add_reference_ratios(stats: dict[str, dict], entry: dict, ref: dict, seeds: list, kw: dict,
                         reference_budget: str) -> None:
    """Pair each C of ``stats`` with the reference priced at the same C: ``h2d_ratio`` (its H2D bytes per delivered
    token over the reference's; −78 % reads 0.22) and ``modeled_ratio`` (its modeled speed-up under offload over the
    reference's), each with per-seed values and the seed-level t interval (:func:`vat.bench.stats.ratio_record`)."""
    for size, figures in stats.items():
        if size not in (ref.get("offload") or {}):
            continue
        h2d = [entry["offload"][size]["h2d_bytes"], entry["kept"]]
        ref_h2d = [ref["offload"][size]["h2d_bytes"], ref["kept"]]
        if entry["seeds"] != [None]:
            index = [entry["seeds"].index(s) for s in seeds]
            h2d = [a[index] for a in h2d]
        ref_index = [ref["seeds"].index(s) for s in seeds]
        ref_h2d = [a[ref_index] for a in ref_h2d]
        keys = ("modeled_ar_seconds", "modeled_seconds")
        figures["h2d_ratio"] = {**ratio_record(tuple(h2d), tuple(ref_h2d), seeds, kw),
                                "reference_budget": reference_budget}
        figures["modeled_ratio"] = {**ratio_record(_pick(entry, size, keys, seeds), _pick(ref, size, keys, seeds),
                                                   seeds, kw), "reference_budget": reference_budget}


def offload_lines(summary: dict, labels: list[str], conf: int) -> list[str]:
    """bench.md's "Under expert offload" section: per budget and benchmark, a row per method and C (and the
    autoregressive baseline's figures per C, read from the reference's cells); [] when no cell was priced."""
    ev = summary["settings"]["eval"]
    ref = summary["reference"]
    tables = []
    for budget in summary["budgets"]:
        for bench in summary["benchmarks"]:
            rows = [(label, size, figures) for label in labels
                    for size, figures in ((summary["results"].get(label, {}).get(budget, {}).get(bench) or {})
                                          .get("offload") or {}).items()]
            if not rows:
                continue
            title = bench if budget == "none" else f"{bench}, expert budget B = {budget}"
            tables += [f"### {title}", "",
                       f"| method | C | hit rate | H2D MiB/token [{conf} % CI] | H2D / {ref} [{conf} % CI] | modeled "
                       f"speed-up over AR under offload [{conf} % CI] | modeled speed-up / {ref} under offload "
                       f"[{conf} % CI] | H2D MiB/token per seed |",
                       "|---|---|---|---|---|---|---|---|"]
            for size in sorted({s for _, s, _ in rows}, key=int):
                ar = next((f for label, s, f in rows if s == size and label == ref), None)
                if ar is not None:
                    tables.append(f"| AR (the reference's tokens) | {size} | {100 * ar['ar_hit_rate']:.1f} % | "
                                  f"{ar['ar_h2d_mib_per_token']:.3f} | – | 1 | – | – |")
                for label, s, f in rows:
                    if s != size:
                        continue
                    is_ref = label == ref and budget == "none"
                    per_seed = " / ".join(f"{v:.3f}" for v in f["per_seed_h2d_mib_per_token"].values())
                    h2d_ratio = "1 (reference)" if is_ref else ratio_cell(f.get("h2d_ratio"), budget)
                    modeled = "1 (reference)" if is_ref else ratio_cell(f.get("modeled_ratio"), budget)
                    tables.append(f"| {label} | {size} | {100 * f['hit_rate']:.1f} % | "
                                  f"{fmt_estimate(f['h2d_mib_per_token'])} | {h2d_ratio} | {fmt_estimate(f['modeled_speedup'])} | "
                                  f"{modeled} | {per_seed} |")
            tables.append("")
    if not tables:
        return []
    return ["## Under expert offload", "",
            f"C of the target's experts per MoE layer resident on the GPU ({ev.get('offload_policy', 'lru')} "
            f"eviction), the rest over {ev.get('offload_link', 'pcie5')} (docs/eval.md \"Expert offloading\"). H2D "
            "MiB per delivered token and the hit rate pool seeds and prompts; the AR row is the same prompts' kept "
            "tokens decoded one forward each. The speed-ups are the cost model's bytes model plus H2D time: modeled, "
            "not measured.", "", *tables]

