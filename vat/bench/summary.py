"""bench.json and bench.md from the cells finished so far (rebuilt after every cell, so a partial bench reads).

Per method (and baseline) x budget x benchmark: τ pooled over seeds and prompts with a bootstrap interval, τ of each
seed, and the ratio to the reference method with a paired bootstrap interval, its per-seed values and a seed-level t
interval (:mod:`vat.bench.stats`; a win needs both lower bounds above 1). Per method: training wall minutes and
tokens per draft, and the curve of τ against training tokens.

τ counts delivered tokens: Σ tokens kept (acceptances past ``max_new_tokens`` or an EOS do not count) / Σ rounds.
``accepted_per_round`` (Σ (accepted + 1) / Σ rounds, the τ of bench records before delivered counting) is given
beside it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from vat.bench.cells import Cell, eval_path, finished, method_eval, recorded
from vat.bench.offload import add_reference_ratios, collect_offload, finish_offload, offload_lines, offload_statistics
from vat.bench.record import per_prompt
from vat.bench.stats import bootstrap_tau, paired_ratio, per_seed_tau, pooled_tau, ratio_record
from vat.bench.text import fmt_estimate, ratio_cell
from vat.errors import VatError
from vat.eval.config import NO_BUDGET
from vat.eval.cost import get_accelerator
from vat.eval.quality import add_counts, empty_counts, summarize_quality
from vat.export.checkpoint import write_text_atomic

BENCH_FORMAT_VERSION = 2  # 2: τ on delivered tokens; ratios with per-seed values, a t interval and `win`
MIB = 1024.0 * 1024.0
EXTRA_COUNTS = ("expert_bytes", "kept", "modeled_seconds", "modeled_ar_seconds")  # per-prompt counts beside τ's


def _budget_label(budget: int | None) -> str:
    return NO_BUDGET if budget is None else str(budget)


def per_prompt_table(cells: list[Cell]) -> dict[tuple[str, str, str], dict]:
    """Counts of the given (finished) cells, stacked by seed: ``(label, budget, benchmark) -> {seeds, ids,
    committed, kept, rounds, ...}`` with ``committed`` (accepted + 1), ``kept`` (delivered tokens) and ``rounds`` of
    shape (S, P) (S = 1 and seed None for a baseline). An eval.json without delivered counts gets ``kept`` =
    ``committed`` and ``tau_counts`` = ``accepted+1``.

    Raises:
        VatError: an eval.json without ``per_prompt`` counts, or cells whose prompts differ (they must pair).
    """
    rows: dict[tuple[str, str, str], dict] = {}
    for cell in cells:
        with open(eval_path(cell)) as f:
            result = json.load(f)
        counts = per_prompt(result)  # a full eval.json or a record's columns
        if counts is None:
            raise VatError(f"{eval_path(cell)} has no per_prompt counts (an older vat eval); delete it to rerun")
        for label, per_budget in counts.items():
            if label != cell.method:
                continue  # an AR pass (only the `none` baseline cell's eval runs one and carries it)
            for budget, per_bench in per_budget.items():
                for bench, prompts in per_bench.items():
                    entry = rows.setdefault((label, budget, bench), {"seeds": [], "ids": None, "committed": [],
                                                                     "rounds": [], "quality": None, "greedy": True, "hashes": [],
                                                                     "offload": {}, **{k: [] for k in EXTRA_COUNTS}})
                    ids = [p["question_id"] for p in prompts]
                    if entry["ids"] is not None and ids != entry["ids"]:
                        raise VatError(f"{cell.name}: the prompts of {bench} differ from the other seeds' (eval "
                                       "settings changed between cells?); delete its eval/ to rerun")
                    entry["ids"] = ids
                    entry["seeds"].append(cell.seed)
                    entry["greedy"] &= float(result["settings"].get("temperature", 0.0)) == 0.0
                    entry["committed"].append([p["committed"] for p in prompts])
                    entry["hashes"].append([p.get("output_hash") for p in prompts])
                    entry["rounds"].append([p["rounds"] for p in prompts])
                    for key in EXTRA_COUNTS:  # expert bytes, kept tokens, modeled seconds (--cost-model)
                        entry[key].append([p.get(key) for p in prompts])
                    collect_offload(entry, prompts)  # H2D counts per resident-cache size (eval.offload)
                    if budget != NO_BUDGET and all("quality" in p for p in prompts):
                        # quality under the budget: counts pooled over seeds and prompts (vat.eval.quality)
                        quality = entry["quality"] or {"counts": empty_counts(), "cells": 0}
                        for p in prompts:
                            add_counts(quality["counts"], p["quality"])
                        quality["cells"] += 1
                        entry["quality"] = quality
    for entry in rows.values():
        entry["tau_counts"] = "delivered"
        if not all(v is not None for row in entry["kept"] for v in row):  # an eval.json older than delivered counts
            entry["kept"], entry["tau_counts"] = [list(row) for row in entry["committed"]], "accepted+1"
        if entry["quality"] is not None and entry["quality"]["cells"] != len(entry["seeds"]):
            entry["quality"] = None  # a seed's older eval.json has none: no figure rather than one over fewer seeds
        entry["committed"] = np.asarray(entry["committed"], dtype=np.float64)  # (S, P)
        entry["rounds"] = np.asarray(entry["rounds"], dtype=np.float64)  # (S, P)
        finish_offload(entry)
        for key in EXTRA_COUNTS:  # None where an older eval.json (or a run without a cost model) lacks the count
            values = entry[key]
            entry[key] = (np.asarray(values, dtype=np.float64)
                          if values and all(v is not None for row in values for v in row) else None)  # (S, P)
    return rows


TAU_KEYS = ("kept", "rounds")  # τ = delivered tokens / rounds


def _rows(entry: dict, seeds: list, keys: tuple[str, str] = TAU_KEYS) -> tuple[np.ndarray, np.ndarray]:
    """The entry's two per-(seed, prompt) arrays ``keys`` for ``seeds``, in that order."""
    index = [entry["seeds"].index(s) for s in seeds]
    return entry[keys[0]][index], entry[keys[1]][index]


def _side(entry: dict, seeds: list, keys: tuple[str, str] = TAU_KEYS) -> tuple[np.ndarray, np.ndarray]:
    """A method's rows for ``seeds``, or a baseline's only row (read against every seed of the other side)."""
    return (entry[keys[0]], entry[keys[1]]) if entry["seeds"] == [None] else _rows(entry, seeds, keys)


def _common_seeds(entry: dict, ref: dict) -> list:
    """The seeds a ratio of ``entry`` to ``ref`` pairs over: all of ``ref``'s for a baseline, else the shared ones."""
    return list(ref["seeds"]) if entry["seeds"] == [None] else [s for s in entry["seeds"] if s in ref["seeds"]]


def _budget_of(rows: dict, label: str, budget: str, bench: str) -> str:
    """The budget a ratio compares against: the same one where ``label`` was evaluated there, else natural routing."""
    return budget if (label, budget, bench) in rows else NO_BUDGET


def method_statistics(rows: dict, labels: list[str], reference: str, boot: Any,
                      versus: tuple[str, ...] = ()) -> dict:
    """τ with an interval, τ per seed and the paired ratio to the reference, per label x budget x benchmark.

    A trained method also gets ``versus[name]``: its paired ratio to each label in ``versus``: a training-free
    baseline (the n-gram draft a user gets for free), paired over its seeds and the shared prompts, or another
    method of the bench's ``compare`` list (e.g. the draft a continuation started from), paired seed by seed.

    The ratio of a trained method uses the seeds both it and the reference have finished (paired by seed); a
    baseline's pairs over prompts with all the reference's seeds. The reference at the same budget is used when it
    was evaluated there, else at natural routing; every ratio records which in ``reference_budget`` (bench.md marks
    the fallback), so a budgeted τ over a natural one is never read as a same-budget ratio.
    """
    kw = {"samples": int(boot.samples), "seed": int(boot.seed), "confidence": float(boot.confidence)}
    out: dict[str, dict] = {}
    for (label, budget, bench), entry in rows.items():
        if label not in labels:
            continue
        tau = bootstrap_tau(entry["kept"], entry["rounds"], **kw)
        stats = {
            "tau": tau.to_dict(),
            "tau_counts": entry["tau_counts"],
            "accepted_per_round": pooled_tau(entry["committed"], entry["rounds"]),
            "seeds": [s for s in entry["seeds"] if s is not None],
            "per_seed": {str(s): t for s, t in zip(entry["seeds"], per_seed_tau(entry["kept"], entry["rounds"]))
                         if s is not None},
            "n_prompts": len(entry["ids"]),
            "ratio": None,
        }
        if budget == NO_BUDGET and entry["greedy"] and label != "none":
            stats["lossless"] = lossless_check(entry, rows.get(("none", NO_BUDGET, bench)))
        if budget != NO_BUDGET:  # a τ under a budget is never given without its quality (None: an older eval.json)
            q = entry.get("quality")
            stats["quality"] = summarize_quality(q["counts"], entry["greedy"]) if q else None
        if entry.get("expert_bytes") is not None and entry.get("kept") is not None:
            # expert MiB per kept token: Σ bytes / Σ tokens, the same crossed bootstrap as τ
            stats["expert_mib_per_token"] = bootstrap_tau(entry["expert_bytes"] / MIB, entry["kept"], **kw).to_dict()
        if entry.get("modeled_seconds") is not None and entry.get("modeled_ar_seconds") is not None:
            # modeled speed-up over AR = Σ modeled AR seconds / Σ modeled seconds (vat.eval.cost)
            stats["modeled_speedup"] = bootstrap_tau(entry["modeled_ar_seconds"], entry["modeled_seconds"],
                                                     **kw).to_dict()
        if entry.get("offload"):  # priced under expert offloading: per resident-cache size C
            stats["offload"] = offload_statistics(entry, kw)
        ref_budget = _budget_of(rows, reference, budget, bench)
        ref = rows.get((reference, ref_budget, bench))
        if ref is not None and ref["ids"] == entry["ids"]:
            if ref is entry:
                stats["ratio"] = {"value": 1.0, "low": 1.0, "high": 1.0, "seeds": stats["seeds"], "reference": True}
            else:
                common = _common_seeds(entry, ref)
                if common:
                    stats["ratio"] = {**ratio_record(_side(entry, common), _rows(ref, common), common, kw),
                                      "reference_budget": ref_budget}
                    if "modeled_speedup" in stats and ref.get("modeled_seconds") is not None:
                        # the modeled speed-up over the reference's, paired as τ's ratio
                        keys = ("modeled_ar_seconds", "modeled_seconds")
                        stats["modeled_ratio"] = {
                            **ratio_record(_side(entry, common, keys), _rows(ref, common, keys), common, kw),
                            "reference_budget": ref_budget}
                    if "offload" in stats:
                        add_reference_ratios(stats["offload"], entry, ref, common, kw, ref_budget)
        if entry["seeds"] != [None]:
            stats["versus"] = {}
            for base in versus:
                base_budget = _budget_of(rows, base, budget, bench)
                other = rows.get((base, base_budget, bench))
                if base == label or other is None or other["ids"] != entry["ids"]:
                    continue
                if other["seeds"] == [None]:  # a training-free baseline: paired over prompts
                    seeds = stats["seeds"]
                    stats["versus"][base] = {**ratio_record((entry["kept"], entry["rounds"]),
                                                            (other["kept"], other["rounds"]), seeds, kw),
                                             "reference_budget": base_budget}
                else:  # another trained method: paired seed by seed, as the reference ratio
                    common = _common_seeds(entry, other)
                    if common:
                        stats["versus"][base] = {**ratio_record(_rows(entry, common), _rows(other, common), common,
                                                                kw), "reference_budget": base_budget}
        out.setdefault(label, {}).setdefault(budget, {})[bench] = stats
    return out


def lossless_check(entry: dict, ar: dict | None) -> dict | None:
    """Greedy decoding at natural routing must reproduce the target's own output: the share of (seed, prompt) runs
    whose output hash equals the autoregressive baseline's on the same prompt (None without hashes or an AR cell)."""
    if ar is None or ar["ids"] != entry["ids"] or not ar["hashes"] or not ar["greedy"]:
        return None
    reference = ar["hashes"][0]
    pairs = [(h, r) for row in entry["hashes"] for h, r in zip(row, reference) if h is not None and r is not None]
    if not pairs:
        return None
    return {"identical": sum(h == r for h, r in pairs), "compared": len(pairs)}


GOAL_BYTES = 0.70  # issue 16's goal: <= 0.70x the reference's natural-routing expert bytes per token ...
GOAL_TAU = 0.98  # ... at >= 0.98x its natural τ ...
GOAL_AGREEMENT = 0.95  # ... with >= 95 % agreement with the natural greedy output


def _goal_score(mib_ratio: dict, tau_ratio: dict, agreement: float | None) -> float:
    """The largest normalised shortfall of the three goals: <= 1 when all hold (inf without an agreement)."""
    return max(mib_ratio["value"] / GOAL_BYTES, GOAL_TAU / tau_ratio["value"],
               GOAL_AGREEMENT / agreement if agreement else float("inf"))


def front_statistics(rows: dict, labels: list[str], reference: str, boot: Any) -> dict:
    """Every label x budget against the reference's natural routing on expert bytes and τ, per benchmark.

    For each entry with expert bytes: ``mib_ratio`` = its expert MiB per generated token over the reference's at
    natural routing, ``tau_ratio`` = its τ over the reference's natural τ (both paired bootstraps as the ratio
    column: seed by seed over the seeds both finished, a baseline over prompts); its ``agreement`` (1 at natural
    routing, where greedy decoding is lossless; None when an older eval.json has no quality or the eval sampled);
    ``tau`` and ``mib_per_token`` pool the same seeds as the ratios; ``front`` = no other point reads at most its
    bytes at at least its τ (point estimates); ``goal_score`` = max(mib_ratio / 0.70, 0.98 / tau_ratio,
    0.95 / agreement), at most 1 when the bytes, τ and agreement goals all hold, the smallest is the closest;
    ``goal_score_stepwise`` the same with the stepwise agreement in place of the positional one.

    Returns:
        ``{benchmark: [point, ...]}`` ordered by MiB per token.
    """
    kw = {"samples": int(boot.samples), "seed": int(boot.seed), "confidence": float(boot.confidence)}
    keys = ("expert_bytes", "kept")
    front: dict[str, list[dict]] = {}
    for (label, budget, bench), entry in rows.items():
        ref = rows.get((reference, NO_BUDGET, bench))
        if label not in labels or ref is None or ref["ids"] != entry["ids"]:
            continue
        if any(e.get(k) is None for e in (entry, ref) for k in keys):
            continue
        common = _common_seeds(entry, ref)
        if not common:
            continue
        tau_ratio = paired_ratio(*_side(entry, common), *_rows(ref, common), **kw).to_dict()
        mib_ratio = paired_ratio(*_side(entry, common, keys), *_rows(ref, common, keys), **kw).to_dict()
        if budget == NO_BUDGET:  # greedy natural routing is the target's own output; sampling has no figure
            agreement, stepwise, kl = (1.0, 1.0, 0.0) if entry["greedy"] else (None, None, None)
        else:
            q = entry.get("quality")
            quality = summarize_quality(q["counts"], entry["greedy"]) if q else {}
            agreement, stepwise, kl = (quality.get(k) for k in ("agreement", "stepwise_agreement", "kl_to_natural"))
        front.setdefault(bench, []).append({
            "label": label, "budget": budget, "seeds": common,
            # the point and its ratios over the same seeds (a half-finished bench pools no seed the ratio lacks)
            "tau": pooled_tau(*_side(entry, common)),
            "mib_per_token": pooled_tau(*_side(entry, common, keys)) / MIB,  # Σ bytes / Σ tokens
            "tau_ratio": tau_ratio, "mib_ratio": mib_ratio, "agreement": agreement,
            "stepwise_agreement": stepwise, "kl_to_natural": kl,
            "goal_score": _goal_score(mib_ratio, tau_ratio, agreement),
            "goal_score_stepwise": _goal_score(mib_ratio, tau_ratio, stepwise),
        })
    for points in front.values():
        points.sort(key=lambda p: p["mib_per_token"])
        for p in points:
            p["front"] = not any(o["mib_per_token"] <= p["mib_per_token"] and o["tau"] >= p["tau"]
                                 and (o["mib_per_token"], o["tau"]) != (p["mib_per_token"], p["tau"]) for o in points)
    return front


def versus_labels(baselines: list[str], compare: list[str]) -> tuple[str, ...]:
    """The labels every trained method gets a ratio column against: the drafting baselines, then ``compare``."""
    return (*(b for b in baselines if b != "none"), *compare)


def best_free_drafts(results: dict, baselines: list[str]) -> dict[str, dict[str, str]]:
    """The free baseline with the highest τ per budget and benchmark (``{budget: {bench: label}}``).

    It is picked on the bench's own prompts: the pick favours the baseline (its best of several on these very
    prompts), so a trained draft's ratio to it is conservative.
    """
    best: dict[str, dict[str, str]] = {}
    for label in baselines:
        if label == "none":
            continue
        for budget, per_bench in results.get(label, {}).items():
            for bench, stats in per_bench.items():
                current = best.setdefault(budget, {}).get(bench)
                tau = stats["tau"]["value"]
                if tau is not None and (current is None or tau > results[current][budget][bench]["tau"]["value"]):
                    best[budget][bench] = label
    return best


def train_statistics(records: dict[str, list[dict]]) -> dict:
    """Per method: mean training wall minutes, tokens and final τ_sim per draft, over its finished seeds."""
    out = {}
    for label, cells in records.items():
        trains = [c["train"] for c in cells if c.get("train")]
        if not trains:
            continue
        out[label] = {
            "drafts": len(trains),
            "minutes_per_draft": float(np.mean([t["seconds"] for t in trains])) / 60.0,
            "tokens_per_draft": float(np.mean([t["tokens"] for t in trains])),
            "steps": trains[0]["steps"],
            "final_tau_sim": _mean([t.get("final_tau_sim") for t in trains]),
        }
    return out


def curve_statistics(records: dict[str, list[dict]], final_on_curve: bool = False) -> dict:
    """Per method and curve step: τ pooled over benchmarks and per benchmark (mean over seeds with the min/max
    spread), training tokens (mean over seeds).

    ``final_on_curve`` (the curve's prompts are the evaluation's: same limit) adds each cell's final evaluation as the
    last point, per benchmark only (cell.json keeps no pooled τ of it), so a curve reaches the trained draft.
    """
    out = {}
    for label, cells in records.items():
        by_step: dict[int, list[tuple[Any, dict]]] = {}
        for cell in cells:
            points = list(cell.get("curve") or [])
            steps = {p["step"] for p in points}
            train, evaluated = cell.get("train") or {}, (cell.get("eval") or {}).get("tau")
            if final_on_curve and points and evaluated and train.get("steps") not in steps:
                points.append({"step": train["steps"], "tokens": train["tokens"], "tau": None,
                               "tau_per_benchmark": evaluated})
            for point in points:
                by_step.setdefault(point["step"], []).append((cell["seed"], point))
        points = []
        for step in sorted(by_step):
            taus = [p["tau"] for _, p in by_step[step] if p["tau"] is not None]
            per_bench: dict[str, list[float]] = {}
            for _, p in by_step[step]:
                for name, tau in (p.get("tau_per_benchmark") or {}).items():
                    if tau is not None:
                        per_bench.setdefault(name, []).append(tau)
            points.append({
                "step": step,
                "tokens": float(np.mean([p["tokens"] for _, p in by_step[step]])),
                "tau_mean": _mean(taus),
                "tau_min": min(taus) if taus else None,
                "tau_max": max(taus) if taus else None,
                "per_seed": {str(seed): p["tau"] for seed, p in by_step[step]},
                "per_benchmark": {name: {"mean": _mean(v), "min": min(v), "max": max(v)}
                                  for name, v in per_bench.items()},
            })
        if points:
            out[label] = points
    return out


def _mean(values: list) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def build_summary(bench: Any, cells: list[Cell], fingerprints: list[str], target: str, settings: dict,
                  as_recorded: bool = False) -> dict:
    """The bench.json dict from every cell finished with its current settings.

    Args:
        bench: the bench config.
        cells: every cell of the bench.
        fingerprints: each cell's current settings fingerprint; a ``cell.json`` recorded under other settings (a
            config changed, the cell not rerun yet) is left out rather than mixed in.
        target: the target directory.
        settings: what bench.json records as ``settings``.
        as_recorded: read every cell with a record as it was recorded, checking no settings (``--render``).
    """
    records: dict[str, list[dict]] = {}
    done_cells = []
    for cell, fingerprint in zip(cells, fingerprints):
        record = (recorded(cell) if as_recorded else finished(cell, fingerprint, bench, cell.target_dir(target)))
        if record is not None:
            records.setdefault(cell.method, []).append(record)
            done_cells.append(cell)
    done = len(done_cells)

    labels = [*bench.methods, *bench.baselines]
    budgets = list(dict.fromkeys(_budget_label(b) for label in [None, *bench.methods]
                                 for b in method_eval(bench, label)["budgets"]))  # the bench's, then methods' own
    rows = per_prompt_table(done_cells)
    on_eval_prompts = bench.curve.limit == bench.eval.limit  # the curve's checkpoints ran on the evaluation's prompts
    results = method_statistics(rows, labels, bench.reference, bench.bootstrap,
                                versus=versus_labels(bench.baselines, bench.compare))
    return {
        "vat_bench_version": BENCH_FORMAT_VERSION,
        "name": bench.name,
        "target": target,
        "reference": bench.reference,
        "methods": list(bench.methods),
        "baselines": list(bench.baselines),
        "compare": list(bench.compare),
        "seeds": list(bench.seeds),
        "benchmarks": sorted({bench_name for (_, _, bench_name) in rows}, key=_bench_order(bench)),
        "budgets": budgets,
        "cost_models": sorted({get_accelerator(m).name for label in [None, *bench.methods]  # canonical spelling
                               if (m := method_eval(bench, label)["cost_model"]) is not None}),
        "progress": {"cells_done": done, "cells_total": len(cells), "complete": done == len(cells)},
        "interval": {"kind": "percentile bootstrap", "resampled": "seeds and prompts (crossed); paired for ratios",
                     "samples": int(bench.bootstrap.samples), "confidence": float(bench.bootstrap.confidence)},
        "settings": settings,
        "results": results,
        "best_free": best_free_drafts(results, list(bench.baselines)),
        "front": front_statistics(rows, labels, bench.reference, bench.bootstrap),
        "train": train_statistics(records),
        "curve": curve_statistics(records, final_on_curve=on_eval_prompts),
        "curve_on_eval_prompts": on_eval_prompts,  # comparable with the free drafts' τ
        "cells": {label: {("baseline" if r["seed"] is None else f"seed{r['seed']}"): r for r in rs}
                  for label, rs in records.items()},
        "free_drafts": free_draft_settings(done_cells),
    }


def free_draft_settings(cells: list[Cell]) -> dict[str, dict]:
    """What each finished training-free baseline ran, from its eval.json (``rule`` absent = the recent-occurrence
    n-gram rule every eval before vLLM's rule used)."""
    out = {}
    for cell in cells:
        if cell.seed is not None or cell.method == "none":
            continue
        with open(eval_path(cell)) as f:
            record = json.load(f).get("drafts", {}).get(cell.method) or {}
        if record.get("mode") == "ngram":
            out[cell.method] = {k: v for k, v in record.items() if k not in ("path", "verification_head",
                                                                              "vh_threshold")}
            out[cell.method].setdefault("rule", "recent")
    return out


def _free_draft_text(label: str, record: dict) -> str:
    if record.get("free_draft") == "suffix":
        return (f"`{label}` = suffix decoding (depth {record['max_depth']}, min probability {record['min_token_prob']}, "
                f"{'with' if record.get('use_global', True) else 'without'} the cache of earlier responses)")
    rule = {"vllm": "vLLM's rule (earliest occurrence)", "recent": "the recent-occurrence rule"}[record["rule"]]
    return f"`{label}` = n-gram prompt lookup, {rule}, n = {record['n_min']}..{record['n_max']}"


def _bench_order(bench: Any):
    """Benchmarks in the config's order (a name with a category filter sorts after its base)."""
    names = [str(b) for b in bench.eval.benchmarks]

    def key(name: str):
        for i, spec in enumerate(names):
            if name == spec or name.split(":")[0] == spec.split(":")[0]:
                return (i, name)
        return (len(names), name)

    return key


# ---- markdown -----------------------------------------------------------------------------------------------------


def _tau_cell(stats: dict) -> str:
    """τ with its interval, and the accepted-per-round figure where acceptances past the cap make it differ."""
    text = fmt_estimate(stats["tau"])
    acc = stats.get("accepted_per_round")
    if acc is not None and abs(acc - stats["tau"]["value"]) >= 5e-4:
        text += f" ({acc:.3f} accepted+1)"
    return text


def _quality_cells(quality: dict | None) -> str:
    """The agreement and KL cells of a budgeted row ('' for a natural-routing table)."""
    if quality is None:
        return ""
    if not quality:
        return "not measured (older eval: rerun) | – | – | "
    agree, step = (_percent(quality.get(k)) for k in ("agreement", "stepwise_agreement"))
    kl = "–" if quality["kl_to_natural"] is None else f"{quality['kl_to_natural']:.4f}"
    return f"{agree} | {step} | {kl} | "


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def markdown(summary: dict) -> str:
    """bench.md: one table per benchmark (and budget), then the curve table."""
    conf = round(100 * summary["interval"]["confidence"])
    lines = _intro_lines(summary, conf)
    lines += _variant_lines(summary)
    labels = summary["methods"] + summary["baselines"]
    train = summary["train"]
    for budget in summary["budgets"]:
        for bench in summary["benchmarks"]:
            lines += _bench_lines(summary, labels, train, budget, bench, conf)
    lines += _front_lines(summary, conf)
    lines += offload_lines(summary, labels, conf)
    lines += _curve_lines(summary)
    lines += _train_lines(train)
    return "\n".join(lines)


def _intro_lines(summary: dict, conf: int) -> list[str]:
    """The title, the partial-bench warning, the settings and how to read the tables, and the free drafts."""
    ref = summary["reference"]
    progress = summary["progress"]
    ev = summary["settings"]["eval"]
    lines = [f"# vat bench: {summary['name']}", ""]
    if not progress["complete"]:
        lines += [f"**Partial: {progress['cells_done']} of {progress['cells_total']} cells finished.**", ""]
    lines += [
        f"Target `{summary['target']}`; seeds {', '.join(map(str, summary['seeds']))}; "
        f"{ev['limit'] or 'all'} prompts per benchmark, {ev['max_new_tokens']} new tokens per turn, K = {ev['steps']}, "
        f"temperature {ev['temperature']}.",
        "τ = delivered tokens per verification round (acceptances past the token cap or an EOS do not count), pooled "
        "over prompts and seeds; where it differs, Σ (accepted + 1) / Σ rounds follows in brackets. Intervals: "
        f"{conf} % {summary['interval']['kind']} ({summary['interval']['samples']} replicates) resampling "
        f"{summary['interval']['resampled']}; each ratio also shows its seed-level t interval over the per-seed "
        "ratios and the per-seed values, and is a **win** only when both lower bounds exceed 1. "
        f"Ratios are τ / τ of `{ref}` (or the named method) at the same budget where it was evaluated there, else at "
        "natural routing (marked †).",
        "",
    ]
    free = summary.get("free_drafts") or {}
    if free:
        lines += ["Free drafts: " + "; ".join(_free_draft_text(k, v) for k, v in free.items()) + ".", ""]
    return lines


def _variant_lines(summary: dict) -> list[str]:
    """The table of methods with an existing draft, their own target or eval overrides ([] when there are none)."""
    variants = [(label, m) for label, m in summary["settings"].get("methods", {}).items()
                if m.get("draft") or m.get("target") or any(v is not None for v in (m.get("eval") or {}).values())]
    if not variants:
        return []
    own_targets = any(m.get("target") for _, m in variants)
    lines = ["Methods that evaluate an existing draft, run on their own target and/or override the bench's eval "
             "settings" + (" (a method on its own target is compared with the reference as a target + draft "
                           "pair)" if own_targets else "") + ":", "",
             "| method | draft | " + ("target | " if own_targets else "") + "eval overrides |",
             "|---|---|" + ("---|" if own_targets else "") + "---|"]
    for label, m in variants:
        overrides = ", ".join(f"{k}={v}" for k, v in (m.get("eval") or {}).items() if v is not None) or "–"
        target = f"{m.get('target') or 'the bench target'} | " if own_targets else ""
        lines.append(f"| {label} | {m.get('draft') or 'trained: ' + str(m.get('recipe'))} | {target}{overrides} |")
    lines.append("")
    return lines


def _bench_lines(summary: dict, labels: list[str], train: dict, budget: str, bench: str, conf: int) -> list[str]:
    """One benchmark's section at one budget: its title, the quality note, the τ table (a row per label with results)
    and the lossless check."""
    title = bench if budget == NO_BUDGET else f"{bench}, expert budget B = {budget}"
    free = [b for b in summary["baselines"] if b != "none"]
    best = (summary.get("best_free") or {}).get(budget, {}).get(bench)
    # a grid of free drafts shows its best one (bench.json keeps the ratio to each)
    versus = [*(free if len(free) <= 2 else [best] if best else []), *summary.get("compare", [])]
    budgeted = budget != NO_BUDGET
    lines = [f"## {title}", ""]
    if budgeted:
        lines += ["Quality beside τ, pooled over seeds and prompts: agreement = per-token agreement with the "
                  "natural greedy output of the same prompt, stepwise agreement = share of the budgeted "
                  "output's tokens the natural target picks greedily after the same prefix, KL to natural = "
                  "KL(budgeted ‖ natural) of the next-token distribution on the target's own text, nats per "
                  "token.", ""]
    rows_here = [summary["results"].get(label, {}).get(budget, {}).get(bench) for label in labels]
    modeled = any(r and "modeled_speedup" in r for r in rows_here)
    lines += _table_head(summary, conf, versus, best, len(free) > 1, budgeted, modeled)
    for label in labels:
        stats = summary["results"].get(label, {}).get(budget, {}).get(bench)
        if stats is None:
            continue
        lines.append(_table_row(label, stats, train, budget, versus, budgeted, modeled))
    lines.append("")
    lines += _lossless_lines(labels, rows_here)
    return lines


def _table_head(summary: dict, conf: int, versus: list[str], best: str | None, several_free: bool, budgeted: bool,
                modeled: bool) -> list[str]:
    """The header and separator rows of a τ table."""
    ref = summary["reference"]
    quality_head = "agreement | stepwise agreement | KL to natural | " if budgeted else ""
    acc = "/".join(summary.get("cost_models") or []) or "?"
    cost_head = (f"expert MiB/token [{conf} % CI] | modeled {acc} speed-up over AR (bytes model) [{conf} % CI] | "
                 f"modeled speed-up / {ref} [{conf} % CI] | ") if modeled else ""
    return [f"| method | τ [{conf} % CI] | {quality_head}{cost_head}ratio to {ref} [{conf} % CI] | "
            + "".join(f"ratio to {b}{' (best free)' if b == best and several_free else ''} "
                      f"[{conf} % CI] | " for b in versus) + "seeds | train min/draft |",
            "|---|---|" + "---|---|---|" * budgeted + "---|---|---|" * modeled + "---|" + "---|" * len(versus)
            + "---|---|"]


def _table_row(label: str, stats: dict, train: dict, budget: str, versus: list[str], budgeted: bool,
               modeled: bool) -> str:
    """One method's row of a τ table (``train``: the summary's training record, for the minutes per draft)."""
    ratio = stats["ratio"]
    shown = "1 (reference)" if ratio and ratio.get("reference") else ratio_cell(ratio, budget)
    seeds = str(len(stats["seeds"])) if stats["seeds"] else "–"
    minutes = f"{train[label]['minutes_per_draft']:.2f}" if label in train else "–"
    against = "".join(f"{ratio_cell(stats.get('versus', {}).get(b), budget)} | " for b in versus)
    # a budgeted row always has its quality cells: {} (not measured) when the eval.json had none
    quality = _quality_cells((stats.get("quality") or {}) if budgeted else None)
    cost = ""
    if modeled:
        mratio = ("1 (reference)" if ratio and ratio.get("reference")
                  else ratio_cell(stats.get("modeled_ratio"), budget))
        cost = (f"{fmt_estimate(stats.get('expert_mib_per_token'), 2)} | {fmt_estimate(stats.get('modeled_speedup'))} | "
                f"{mratio} | ")
    return f"| {label} | {_tau_cell(stats)} | {quality}{cost}{shown} | {against}{seeds} | {minutes} |"


def _lossless_lines(labels: list[str], rows: list[dict | None]) -> list[str]:
    """The greedy-output check against autoregressive decoding under a τ table ([] when no row has one)."""
    checks = {label: r["lossless"] for label, r in zip(labels, rows) if r and r.get("lossless")}
    if not checks:
        return []
    verdict = "lossless" if all(c["identical"] == c["compared"] for c in checks.values()) else "NOT lossless"
    return [f"Greedy outputs against autoregressive decoding (same prompts, output hashes): {verdict}: "
            + ", ".join(f"{k} {c['identical']}/{c['compared']}" for k, c in checks.items()) + ".", ""]


def _curve_lines(summary: dict) -> list[str]:
    """The τ-against-training-tokens section ([] without a curve): pooled and per-benchmark τ per step, then where
    each method's mean τ first reaches the best free draft's."""
    if not summary["curve"]:
        return []
    benches = [b for b in summary["benchmarks"]
               if any(b in p.get("per_benchmark", {}) for points in summary["curve"].values() for p in points)]
    lines = ["## τ against training tokens", "",
             "Checkpoints evaluated on the curve's prompt subset (the last step is the final evaluation when the "
             "curve's prompts are the evaluation's), τ pooled over benchmarks and per benchmark; mean over seeds "
             "and the range.", "",
             "| method | step | training tokens | τ pooled | τ min–max | " + " | ".join(benches) + " | seeds |",
             "|---|---|---|---|---|" + "---|" * len(benches) + "---|"]
    for label, points in summary["curve"].items():
        for p in points:
            spread = "–" if p["tau_min"] is None else f"{p['tau_min']:.3f}–{p['tau_max']:.3f}"
            mean = "–" if p["tau_mean"] is None else f"{p['tau_mean']:.3f}"
            per = [p.get("per_benchmark", {}).get(b) for b in benches]
            cells = ["–" if t is None else f"{t['mean']:.3f}" for t in per]
            lines.append(f"| {label} | {p['step']} | {p['tokens']:,.0f} | {mean} | {spread} | "
                         + " | ".join(cells) + f" | {len(p['per_seed'])} |")
    lines += [""] + _crossing_lines(summary, benches)
    return lines


def free_tau(summary: dict, bench: str) -> tuple[str, float] | None:
    """The best free draft on ``bench`` at natural routing and its τ (None when the bench has none)."""
    label = summary.get("best_free", {}).get(NO_BUDGET, {}).get(bench)
    if label is None:
        return None
    return label, summary["results"][label][NO_BUDGET][bench]["tau"]["value"]


def _crossing_lines(summary: dict, benches: list[str]) -> list[str]:
    """Per benchmark: the best free draft's τ and the first curve step where each method's mean τ reaches it (only
    when the curve ran on the evaluation's prompts, the free drafts' own)."""
    out = []
    if not summary.get("curve_on_eval_prompts"):
        return out
    for bench in benches:
        free = free_tau(summary, bench)
        if free is None:
            continue
        label, tau = free
        reached = []
        for method, points in summary["curve"].items():
            first = next((p for p in points if (p.get("per_benchmark", {}).get(bench) or {}).get("mean", 0) >= tau),
                         None)
            reached.append(f"{method} {'not within the curve' if first is None else 'at step ' + str(first['step'])}")
        out.append(f"- {bench}: best free draft `{label}`, τ {tau:.3f}; reached by " + ", ".join(reached) + ".")
    return out + ([""] if out else [])


def _train_lines(train: dict) -> list[str]:
    """The training section: drafts, steps, tokens and wall time per method ([] when nothing was trained)."""
    if not train:
        return []
    lines = ["## Training", "", "| method | drafts | steps | training tokens/draft | wall min/draft | final τ_sim |",
             "|---|---|---|---|---|---|"]
    for label, t in train.items():
        tau_sim = "–" if t["final_tau_sim"] is None else f"{t['final_tau_sim']:.3f}"
        lines.append(f"| {label} | {t['drafts']} | {t['steps']} | {t['tokens_per_draft']:,.0f} | "
                     f"{t['minutes_per_draft']:.2f} | {tau_sim} |")
    lines.append("")
    return lines


def _front_lines(summary: dict, conf: int) -> list[str]:
    """The bytes-against-τ section of bench.md: every method x budget against the reference's natural routing."""
    front = summary.get("front") or {}
    if not front:
        return []
    ref = summary["reference"]
    lines = ["## Expert bytes per generated token against τ", "",
             f"Every method x budget against `{ref}` at natural routing (paired ratios, {conf} % intervals). Goal "
             f"(issue 16): <= {GOAL_BYTES:.2f}x its MiB per token at >= {GOAL_TAU:.2f}x its τ with agreement >= "
             f"{100 * GOAL_AGREEMENT:.0f} %; goal score = max(MiB ratio / {GOAL_BYTES:.2f}, {GOAL_TAU:.2f} / τ ratio, "
             f"{GOAL_AGREEMENT:.2f} / agreement), <= 1 when all three hold. Front = no point (lossless or lossy) "
             "reads fewer bytes at a higher τ. Lossless and lossy points are tabled apart; agreement (and stepwise "
             "agreement: the share of the output's tokens the natural target picks greedily after the same prefix) is "
             "100 % at natural routing (greedy decoding is lossless).", ""]
    for bench in summary["benchmarks"]:
        points = front.get(bench)
        if not points:
            continue
        lines += [f"### {bench}", ""]
        results = summary.get("results") or {}
        for lossy, title in ((False, "Lossless: natural routing, the target's own output distribution"),
                             (True, "Lossy: expert budgets and budget policies change the output (quality beside "
                                    "τ)")):
            part = [p for p in points if (p["budget"] != NO_BUDGET) == lossy]
            if part:
                lines += [f"{title}:", ""] + _front_table(part, results, bench, ref, conf, lossy) + [""]
        for key, measure in (("goal_score", ""), ("goal_score_stepwise", "Secondary (a metric added after the goal was "
                                                                         "set; the verdict is the line above): with "
                                                                         "the stepwise agreement in its place, ")):
            best = min(points, key=lambda p: p[key])
            if best[key] == float("inf"):  # no point has that agreement (older evals)
                continue
            verdict = "meets the goal" if best[key] <= 1 else "is the closest to the goal"
            lines.append(f"{measure}`{best['label']}` at budget {best['budget']} {verdict} (score {best[key]:.2f}).")
        lines.append("")
    return lines


def _front_table(points: list[dict], results: dict, bench: str, ref: str, conf: int, lossy: bool) -> list[str]:
    """One front table (the lossless or the lossy points of a benchmark): τ and bytes against the reference's natural
    routing, the modeled speed-up over AR where a cost model ran, and for lossy points their quality."""
    def speedup(p: dict) -> str:
        stats = results.get(p["label"], {}).get(p["budget"], {}).get(bench) or {}
        return fmt_estimate(stats.get("modeled_speedup"))

    modeled = any(speedup(p) != "–" for p in points)
    quality_head = "agreement | stepwise agreement | KL to natural | " if lossy else ""
    head = (f"| method | budget | τ | τ / {ref} natural [{conf} % CI] | MiB/token | MiB / {ref} natural [{conf} % CI] | "
            + ("modeled speed-up over AR (bytes model) | " if modeled else "") + quality_head + "front | goal score |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for p in points:
        kl = "–" if p["kl_to_natural"] is None else f"{p['kl_to_natural']:.4f}"
        quality = (f"{_percent(p['agreement'])} | {_percent(p.get('stepwise_agreement'))} | {kl} | " if lossy else "")
        lines.append(f"| {p['label']} | {p['budget']} | {p['tau']:.3f} | {fmt_estimate(p['tau_ratio'])} | "
                     f"{p['mib_per_token']:.2f} | {fmt_estimate(p['mib_ratio'])} | "
                     + (f"{speedup(p)} | " if modeled else "") + quality
                     + f"{'yes' if p['front'] else ''} | {p['goal_score']:.2f} |")
    return lines


def write_summary(summary: dict, out: str) -> list[str]:
    """Write bench.json and bench.md atomically; returns their paths."""
    paths = []
    for name, text in (("bench.json", json.dumps(summary, separators=(",", ":"))), ("bench.md", markdown(summary))):
        path = os.path.join(out, name)
        write_text_atomic(path, text)
        paths.append(path)
    return paths

