"""A bench's record: what a repository keeps of a finished bench, small enough to commit, enough to recompute it.

``vat bench CONFIG --record DIR`` copies from the bench's output directory its summary (bench.json, bench.md, the PNGs),
writes the config that summary was rendered with (bench_config.yaml: a seed shard may have left another one in the
output directory) and, per cell, cell.json, the training config and the evaluation's settings, with each eval.json
cut to what ``vat bench --render`` reads: the settings, the drafts, and the per-prompt counts (stored by column, one
list per count and nested columns for a nested dict, instead of one dict per prompt). Left out: checkpoints, drafts, training metrics, the curve points'
own evaluations (their τ is in cell.json) and the eval's aggregate tables (rebuilt from the counts). A record renders
the same tables as the full bench: ``vat bench DIR/bench_config.yaml output_dir=DIR --render``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any

from omegaconf import OmegaConf

from vat.bench.cells import plan_cells, report_dir
from vat.errors import VatError
from vat.export.checkpoint import write_text_atomic

# the eval.json keys a record keeps: what the bench summary reads, and what says how the eval ran
EVAL_KEYS = ("vat_eval_version", "target", "target_info", "settings", "cost_model", "drafts", "benchmarks",
             "benchmark_sources", "skipped", "quality_reference", "seconds")  # no generated text: `examples` is a run artefact
COLUMNS_KEY = "per_prompt_columns"  # {label: {budget: {benchmark: {count: [value per prompt] or nested columns}}}}
SUMMARY_FILES = ("bench.json", "bench.md", "bench_config.yaml")
CELL_FILES = ("cell.json", os.path.join("eval", "bench_settings.json"), os.path.join("train", "config.yaml"))


FLOAT_DIGITS = 12  # significant digits a record keeps of a non-integral count (modeled seconds, KL sums)


def _compact_number(value: Any) -> Any:
    """An integral float as an int (byte and token counts are written as floats): same value, fewer characters; any
    other float to :data:`FLOAT_DIGITS` significant digits (its last digits are rounding noise of the cost model)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, float):
        return float(f"{value:.{FLOAT_DIGITS}g}")
    return value


def to_columns(prompts: list[dict]) -> dict[str, Any]:
    """One benchmark's per-prompt dicts as columns: one list per count, and a nested dict (``quality``, the offload
    counts per cache size) as nested columns, ``{"offload": {"24": {"h2d_bytes": [value per prompt]}}}``.

    Every prompt should carry the same keys (an eval writes them so); a key some prompts lack is kept with None there.
    """
    keys: list[str] = []
    for prompt in prompts:
        keys += [k for k in prompt if k not in keys]
    columns: dict[str, Any] = {}
    for key in keys:
        values = [prompt.get(key) for prompt in prompts]
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, dict) for v in present):
            columns[key] = to_columns([v if isinstance(v, dict) else {} for v in values])
        else:
            columns[key] = [_compact_number(v) for v in values]
    return columns


def _column_length(columns: dict[str, Any]) -> int:
    for values in columns.values():
        if isinstance(values, list):
            return len(values)
        length = _column_length(values)
        if length:
            return length
    return 0


def from_columns(columns: dict[str, Any]) -> list[dict]:
    """The per-prompt dicts :func:`to_columns` was given (None entries and empty nested dicts dropped).

    Also reads the first record layout, where a nested dict was flattened one level into ``a.b`` columns.
    """
    prompts: list[dict] = [{} for _ in range(_column_length(columns))]
    for key, values in columns.items():
        if isinstance(values, dict):
            for prompt, nested in zip(prompts, from_columns(values)):
                if nested:
                    prompt[key] = nested
            continue
        outer, _, inner = key.partition(".")
        for prompt, value in zip(prompts, values):
            if value is None:
                continue
            if inner:  # the first layout's ``quality.<key>`` column
                prompt.setdefault(outer, {})[inner] = value
            else:
                prompt[key] = value
    return prompts


def per_prompt(result: dict) -> dict | None:
    """An eval.json's per-prompt counts, ``{label: {budget: {benchmark: [prompt dict]}}}``, from a full eval.json or
    a record's column layout; None when it has neither (an eval older than per-prompt counts)."""
    if "per_prompt" in result:
        return result["per_prompt"]
    if COLUMNS_KEY not in result:
        return None
    return {label: {budget: {bench: from_columns(cols) for bench, cols in per_bench.items()}
                    for budget, per_bench in per_budget.items()}
            for label, per_budget in result[COLUMNS_KEY].items()}


def compact_eval(result: dict) -> dict:
    """An eval.json cut to :data:`EVAL_KEYS` plus its per-prompt counts by column (raises KeyError without them)."""
    counts = per_prompt(result)
    if counts is None:
        raise KeyError("per_prompt")
    out = {key: result[key] for key in EVAL_KEYS if key in result}
    out[COLUMNS_KEY] = {label: {budget: {bench: to_columns(prompts) for bench, prompts in per_bench.items()}
                                for budget, per_bench in per_budget.items()}
                        for label, per_budget in counts.items()}
    return out


def _write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


def _copy(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(src, dst)


def record_cell(cell: str, dest: str) -> list[str]:
    """Write one finished cell's record (:data:`CELL_FILES`, its eval.json compacted) from folder ``cell`` to folder
    ``dest``; returns the paths written."""
    kept = []
    for name in CELL_FILES:
        if os.path.isfile(os.path.join(cell, name)):
            _copy(os.path.join(cell, name), os.path.join(dest, name))
            kept.append(os.path.join(dest, name))
    eval_json = os.path.join(cell, "eval", "eval.json")
    if os.path.isfile(eval_json):
        with open(eval_json) as f:
            compact = compact_eval(json.load(f))
        _write_json(os.path.join(dest, "eval", "eval.json"), compact)
        kept.append(os.path.join(dest, "eval", "eval.json"))
    return kept


def summary_differs_from_config(summary: dict, bench: Any) -> str:
    """What a rendered bench.json says differently from ``bench`` about which cells its tables pair (methods,
    baselines, compare, reference, seeds), e.g. ``methods ['a', 'b'] against ['a', 'b', 'c']``; '' when nothing (a key
    the summary lacks is not compared)."""
    wanted = {"methods": sorted(bench.methods), "baselines": sorted(bench.baselines), "compare": sorted(bench.compare),
              "reference": bench.reference, "seeds": sorted(bench.seeds)}
    differs = []
    for key, value in wanted.items():
        if key not in summary:  # a summary written before the key existed says nothing about it
            continue
        have = summary[key]
        have = sorted(have) if isinstance(have, list) else have
        if have != value:
            differs.append(f"{key} {have} against {value}")
    return ", ".join(differs)


def write_record(bench: Any, dest: str) -> dict[str, int]:
    """Write the record of a bench (a :class:`vat.bench.config.BenchConfig` whose cells ran) to folder ``dest``.

    Returns:
        ``{"files": n, "bytes": total, "cells": finished cells}`` of the record.

    Raises:
        VatError: the bench has no bench.json yet (nothing finished), or ``dest`` is the bench's own output.
    """
    cells_dir = os.path.abspath(bench.output_dir)
    report = report_dir(cells_dir, bench.name)
    if not os.path.isfile(os.path.join(report, "bench.json")):
        raise VatError(f"{report} has no bench.json: run the bench (or --render it) before recording it")
    with open(os.path.join(report, "bench.json")) as f:
        differs = summary_differs_from_config(json.load(f), bench)
    if differs:
        raise VatError(f"{report}/bench.json was rendered with another config ({differs}; e.g. a shard started before "
                       "the config changed): pass --render with --record to render it from the cells first")
    if os.path.abspath(dest) in (cells_dir, os.path.abspath(report)):
        raise VatError(f"--record {dest}: that is the bench's own output; name another folder")
    kept: list[str] = []
    for name in [*SUMMARY_FILES, *(os.path.basename(p) for p in glob.glob(os.path.join(report, "*.png")))]:
        if name == "bench_config.yaml":  # the config the summary was checked against, not the last shard's
            os.makedirs(dest, exist_ok=True)
            write_text_atomic(os.path.join(dest, name), OmegaConf.to_yaml(bench))
            kept.append(os.path.join(dest, name))
        elif os.path.isfile(os.path.join(report, name)):
            _copy(os.path.join(report, name), os.path.join(dest, name))
            kept.append(os.path.join(dest, name))
    cells = [c for c in plan_cells(bench, cells_dir) if os.path.isfile(os.path.join(c.directory, "cell.json"))]
    for cell in cells:
        kept += record_cell(cell.directory, os.path.join(dest, os.path.relpath(cell.directory, cells_dir)))
    return {"files": len(kept), "bytes": sum(os.path.getsize(p) for p in kept), "cells": len(cells)}
