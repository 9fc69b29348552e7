"""One paired ratio pooled over bench records of several target builds.

A tiny target built on another machine has other weights (docs/tiny_target.md), so a bench's seeds on one build do not
pool with another build's in the bench's own tables. A paired ratio does pool: each (build, seed) row compares two
drafts trained with that seed for that build and evaluated on the same test prompts, so the rows are replicates of one
experiment over builds and seeds together. :func:`pool_ratio` stacks the rows of several records (``vat bench
--record`` folders, or run folders) and computes the ratio as the bench does (:func:`vat.bench.stats.ratio_record`:
the crossed bootstrap over rows and prompts, the per-row ratios and the t interval over rows); the t interval then
covers the spread between builds as well as between seeds.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from vat.bench.record import per_prompt
from vat.bench.stats import ratio_record
from vat.errors import VatError
from vat.eval.config import NO_BUDGET

SETTINGS_COMPARED = ("mode", "steps", "tree", "temperature", "budgets", "policy", "max_new_tokens", "limit")


@dataclass
class PooledRows:
    """The rows of one benchmark: ``labels`` ``record:seedN``; ``kept`` / ``rounds`` (rows, prompts) per side."""

    labels: list[str]
    ids: list
    kept: dict[str, list[list[float]]]
    rounds: dict[str, list[list[float]]]


def _eval(cell_dir: str) -> dict | None:
    """A finished cell's eval.json (full, or a record's compact one), or None."""
    path = os.path.join(cell_dir, "eval", "eval.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _seeds(record: str, method: str) -> list[int]:
    found = glob.glob(os.path.join(record, "cells", method, "seed*"))
    return sorted(int(m.group(1)) for p in found if (m := re.fullmatch(r"seed(\d+)", os.path.basename(p))))


def collect_rows(records: list[str], method: str, reference: str) -> dict[str, PooledRows]:
    """Every (record, seed) where both ``method`` and ``reference`` finished, per benchmark (natural routing).

    Raises:
        VatError: no record has a pair, the records evaluated other prompts or with other settings, or a record is
            named twice.
    """
    real = [os.path.realpath(r) for r in records]
    if len(set(real)) != len(real):
        raise VatError("a record is named twice: its rows would count twice")
    rows: dict[str, PooledRows] = {}
    settings: dict | None = None
    for record in records:
        name = os.path.basename(os.path.normpath(record))
        for seed in _seeds(record, method):
            pair = {side: _eval(os.path.join(record, "cells", label, f"seed{seed}"))
                    for side, label in (("method", method), ("reference", reference))}
            if any(v is None for v in pair.values()):
                continue
            for side, label in (("method", method), ("reference", reference)):
                ran = {k: pair[side]["settings"].get(k) for k in SETTINGS_COMPARED}
                if settings is None:
                    settings = ran
                elif ran != settings:
                    raise VatError(f"{record} seed {seed} ({label}) ran with other eval settings: "
                                   f"{ {k: v for k, v in ran.items() if settings.get(k) != v} } against "
                                   f"{ {k: settings[k] for k in ran if settings.get(k) != ran[k]} }")
            counts = {side: per_prompt(ev)[label][NO_BUDGET]
                      for (side, ev), label in zip(pair.items(), (method, reference))}
            for bench, prompts in counts["method"].items():
                ref_prompts = counts["reference"].get(bench)
                if ref_prompts is None:
                    continue
                ids = [p["question_id"] for p in prompts]
                entry = rows.setdefault(bench, PooledRows([], ids, {"method": [], "reference": []},
                                                          {"method": [], "reference": []}))
                if ids != entry.ids or [p["question_id"] for p in ref_prompts] != ids:
                    raise VatError(f"{record} seed {seed}: the prompts of {bench} differ from the other rows'")
                entry.labels.append(f"{name}:seed{seed}")
                for side, side_prompts in (("method", prompts), ("reference", ref_prompts)):
                    entry.kept[side].append([p.get("kept", p["committed"]) for p in side_prompts])
                    entry.rounds[side].append([p["rounds"] for p in side_prompts])
    if not rows:
        raise VatError(f"no record has both {method} and {reference} finished at the same seed")
    return rows


def pool_ratio(records: list[str], method: str, reference: str, samples: int = 2000, seed: int = 0,
               confidence: float = 0.95) -> dict:
    """τ(method) / τ(reference) over every (record, seed) row, per benchmark.

    Returns:
        ``{benchmark: {"rows": n, "tau": {method, reference}, "ratio": ratio_record(...)}}``; τ is delivered tokens
        per round pooled over rows and prompts; ``ratio["per_seed"]`` is keyed by ``record:seedN``.
    """
    out = {}
    for bench, rows in collect_rows(records, method, reference).items():
        kept = {side: np.asarray(v, dtype=np.float64) for side, v in rows.kept.items()}  # (rows, P)
        rounds = {side: np.asarray(v, dtype=np.float64) for side, v in rows.rounds.items()}
        ratio = ratio_record((kept["method"], rounds["method"]), (kept["reference"], rounds["reference"]),
                             rows.labels, {"samples": samples, "seed": seed, "confidence": confidence})
        out[bench] = {"rows": len(rows.labels), "n_prompts": len(rows.ids),
                      "tau": {side: float(kept[side].sum() / rounds[side].sum()) for side in kept}, "ratio": ratio}
    return out


def pooled_markdown(pooled: dict, method: str, reference: str) -> str:
    """The pooled ratios as a Markdown table, one row per benchmark."""
    lines = [f"| benchmark | rows (build:seed) | τ {method} | τ {reference} | ratio [bootstrap] | t interval | "
             "per row | win |", "|---|---|---|---|---|---|---|---|"]
    for bench, entry in pooled.items():
        r, t = entry["ratio"], entry["ratio"]["t"]
        per_row = " / ".join(f"{v:.3f}" for v in r["per_seed"].values())
        t_text = "–" if t is None else f"[{t['low']:.3f}, {t['high']:.3f}]"
        lines.append(f"| {bench} | {entry['rows']} | {entry['tau']['method']:.3f} | {entry['tau']['reference']:.3f} | "
                     f"{r['value']:.3f} [{r['low']:.3f}, {r['high']:.3f}] | {t_text} | {per_row} | "
                     f"{'yes' if r['win'] else 'no'} |")
    labels = next(iter(pooled.values()))["ratio"]["per_seed"]
    return "\n".join(lines) + "\n\nRows: " + ", ".join(labels) + "\n"
