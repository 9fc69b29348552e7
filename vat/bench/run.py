"""`vat bench CONFIG [key=value ...]`: seeds x methods trained on the same data, order and steps, every cell evaluated
with the real engine, τ per benchmark with bootstrap intervals and paired ratios to the reference (docs/bench.md).

``main(args)`` is setup -> run -> write; :func:`run_bench` takes a loaded :class:`vat.bench.config.BenchConfig`. After
every cell, bench.json, bench.md and the PNGs are rebuilt from the cells finished so far.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from typing import Any

from omegaconf import OmegaConf

from vat.bench.cells import (
    Cell,
    cell_fingerprint,
    check_same_training,
    finished,
    plan_cells,
    recorded,
    report_dir,
    resolve_recipe,
    run_cell,
    train_stage,
)
from vat.bench.config import config_changes, load_bench_config
from vat.bench.plots import write_plots
from vat.bench.record import write_record
from vat.bench.summary import build_summary, write_summary
from vat.config import closest_hint
from vat.errors import VatError
from vat.export.checkpoint import read_draft_config, write_text_atomic
from vat.paths import TINY_TARGET_NAMES, tiny_target_dir
from vat.target.model import resolve_target_path as resolve


class Eta:
    """Estimates the time left from the cells that did real work, one mean per kind (trained, baseline).

    A baseline cell is one evaluation, so before one has run it is estimated by the trained cells' evaluation time.
    """

    def __init__(self, cells: list[Cell]):
        self.start = time.time()
        self.left = {"trained": sum(c.trained for c in cells), "baseline": sum(not c.trained for c in cells)}
        self.seconds: dict[str, list[float]] = {"trained": [], "baseline": [], "eval": []}

    def done(self, cell: Cell, seconds: float | None, eval_seconds: float | None = None) -> None:
        kind = "trained" if cell.trained else "baseline"
        self.left[kind] -= 1
        if seconds is not None:
            self.seconds[kind].append(seconds)
            if eval_seconds is not None:
                self.seconds["eval"].append(eval_seconds)

    def text(self) -> str:
        elapsed = (time.time() - self.start) / 60
        per = {k: sum(v) / len(v) for k, v in self.seconds.items() if v}
        baseline = per.get("baseline", per.get("eval"))
        if (self.left["trained"] and "trained" not in per) or (self.left["baseline"] and baseline is None):
            return f"{elapsed:.1f} min elapsed"
        left = self.left["trained"] * per.get("trained", 0.0) + self.left["baseline"] * (baseline or 0.0)
        return f"{elapsed:.1f} min elapsed, about {left / 60:.1f} min left"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _cell_line(cell: Cell, record: dict) -> str:
    parts = []
    train = record.get("train")
    if train:
        verb = "reused draft" if train["reused"] else f"trained {train['steps']} steps"
        tau_sim = "" if train["final_tau_sim"] is None else f", τ_sim {train['final_tau_sim']:.3f}"
        parts.append(f"{verb} ({train['tokens'] / 1e3:.1f}k tokens, {_duration(train['seconds'])}{tau_sim})")
    ev = record["eval"]
    taus = ", ".join(f"{b} {t:.3f}" for b, t in ev["tau"].items() if t is not None)
    parts.append(f"τ {taus}" + ("" if ev["reused"] else f" (eval {_duration(ev['seconds'])})"))
    if record.get("curve"):
        parts.append("curve " + ", ".join(f"step {p['step']} τ {p['tau']:.3f}" for p in record["curve"]
                                          if p["tau"] is not None))
    return "; ".join(parts)


def _settings(bench: Any, cells: list[Cell]) -> dict:
    """The bench config as recorded in bench.json, with each method's recipe path and resolved training essentials."""
    settings = OmegaConf.to_container(bench, resolve=True)
    for cell in cells:
        if cell.draft is not None:
            settings["methods"][cell.method].setdefault("draft_paths", {})[str(cell.seed)] = cell.draft
    first = {c.method: c.train_cfg for c in cells if c.has_training}
    for label, cfg in first.items():
        settings["methods"][label].update({
            "recipe_path": resolve_recipe(bench.methods[label].recipe), "method": cfg.method,
            "max_steps": cfg.train.max_steps, "data": cfg.data.train, "tokens_per_batch": cfg.data.tokens_per_batch,
        })
    return settings


def write_outputs(bench: Any, cells: list[Cell], fingerprints: list[str], target: str, out: str,
                  as_recorded: bool = False) -> list[str]:
    """Rebuild bench.json, bench.md and the PNGs from every finished cell; returns the paths written."""
    summary = build_summary(bench, cells, fingerprints, target, _settings(bench, cells), as_recorded)
    return write_summary(summary, out) + write_plots(summary, out)


def run_bench(bench: Any, progress: bool | None = None, render_only: bool = False,
              only: list[str] | None = None, train_only: bool = False) -> dict:
    """Run every cell not finished yet, rebuilding the outputs after each; returns the bench.json dict.

    Args:
        bench: a :class:`vat.bench.config.BenchConfig`.
        progress: show the trainer's and the engine's progress bars (default: when stderr is a terminal).
        render_only: run nothing; rebuild bench.json, bench.md and the PNGs from the cells already finished (a bench
            record re-read under the current statistics).
        only: run only the cells of these methods and baselines (a bench sharded by method); the outputs still cover
            every finished cell.
        train_only: train (or resume) the drafts of the selected cells and evaluate nothing; a later run without it
            reuses them (the same resolved training config) and evaluates. Baselines and draft cells are skipped.
    """
    progress = sys.stderr.isatty() if progress is None else progress
    cells_dir = os.path.abspath(bench.output_dir)
    out = report_dir(cells_dir, bench.name)
    os.makedirs(out, exist_ok=True)
    if not render_only:
        changes = config_changes(os.path.join(out, "bench_config.yaml"), bench)
        if changes:  # a shard with other overrides than the run it joins: the summary follows the latest config
            print(f"[vat bench] warning: this config differs from the one {out} was run with ({changes}); cells "
                  "keep their own settings, the summary now follows this config", flush=True)
        write_text_atomic(os.path.join(out, "bench_config.yaml"), OmegaConf.to_yaml(bench))
    cells = plan_cells(bench, cells_dir)
    selected = select_cells(cells, only)  # before the target is built: a bad name stops at once
    for warning in check_same_training(cells):
        print(f"[vat bench] warning: {warning}", flush=True)
    trained = [c for c in cells if c.has_training]
    target = _bench_target(cells, build=not render_only)  # rendering reads records: it builds no tiny target
    for cell in trained:
        cell.train_cfg.logging.progress = bool(progress and cell.train_cfg.logging.progress)
    print(f"[vat bench] {bench.name}: {len(bench.methods)} methods x {len(bench.seeds)} seeds + "
          f"{len(bench.baselines)} baselines = {len(cells)} cells -> {out}", flush=True)
    fingerprints = _fingerprints(bench, cells, target)
    if render_only:
        done = sum(recorded(c) is not None for c in cells)
        paths = write_outputs(bench, cells, fingerprints, target, out, as_recorded=True)
        print(f"[vat bench] rendered {done} of {len(cells)} finished cells: "
              f"{', '.join(os.path.relpath(p, out) for p in paths)} in {out}", flush=True)
        _note_seeds_left_out(bench, cells_dir)
        with open(os.path.join(out, "bench.json")) as f:
            return json.load(f)
    if train_only:
        _train_only([cells[i] for i in selected if cells[i].has_training])
        return {}
    eta = Eta([cells[i] for i in selected])
    for n, i in enumerate(selected, 1):
        cell = cells[i]
        head = f"[vat bench {n}/{len(selected)}] {cell.name}"
        own_target = cell.target_dir(target)
        # a draft or commitment file an earlier cell (or another shard) makes exists only now: hash them all now
        fingerprints = _fingerprints(bench, cells, target)
        fingerprint = fingerprints[i]
        if finished(cell, fingerprint, bench, own_target) is not None:
            eta.done(cell, None)
            print(f"{head}: finished earlier, skipped | {eta.text()}", flush=True)
            continue
        start = time.time()
        record = run_cell(bench, cell, own_target, fingerprint, progress)
        worked = not (record.get("train", {}).get("reused", True) and record["eval"]["reused"])
        eta.done(cell, time.time() - start if worked else None, record["eval"]["seconds"] or None)
        fingerprints = _fingerprints(bench, cells, target)  # cells another shard finished meanwhile count too
        write_outputs(bench, cells, fingerprints, target, out)
        print(f"{head}: {_cell_line(cell, record)} | {eta.text()}", flush=True)
    paths = write_outputs(bench, cells, _fingerprints(bench, cells, target), target, out)
    print(f"[vat bench] done: {', '.join(os.path.relpath(p, out) for p in paths)} in {out}", flush=True)
    _note_seeds_left_out(bench, cells_dir)
    with open(os.path.join(out, "bench.json")) as f:
        return json.load(f)


def seeds_left_out(bench: Any, cells_dir: str) -> list[int]:
    """Seeds with a finished cell (cell.json) of one of the bench's methods under ``cells_dir`` that the config's
    ``seeds`` leave out of the summary: what a seed shard's config, left in the run folder, hides from a render."""
    found = set()
    for path in glob.glob(os.path.join(cells_dir, "cells", "*", "seed*", "cell.json")):
        label, seed_dir = path.split(os.sep)[-3:-1]
        if label in bench.methods and seed_dir[4:].isdigit():
            found.add(int(seed_dir[4:]))
    return sorted(found - {int(s) for s in bench.seeds})


def _note_seeds_left_out(bench: Any, cells_dir: str) -> None:
    left_out = seeds_left_out(bench, cells_dir)
    if left_out:
        every = sorted({*left_out, *(int(s) for s in bench.seeds)})
        print(f"[vat bench] note: finished cells of seeds {left_out} are not in this config's seeds "
              f"{[int(s) for s in bench.seeds]}, so the tables leave them out; render them with "
              f"'seeds=[{','.join(map(str, every))}]' --render", flush=True)


def _fingerprints(bench: Any, cells: list[Cell], target: str) -> list[str]:
    """Every cell's fingerprint from the files as they are now: a draft another cell or shard wrote since is hashed."""
    return [cell_fingerprint(bench, cell, cell.target_dir(target)) for cell in cells]


def _train_only(cells: list[Cell]) -> None:
    """Train each cell's draft (reused when final, resumed when killed) without evaluating it."""
    for n, cell in enumerate(cells, 1):
        train = train_stage(cell.train_cfg)
        verb = "reused draft" if train["reused"] else f"trained {train['steps']} steps"
        print(f"[vat bench {n}/{len(cells)}] {cell.name}: {verb} ({_duration(train['seconds'])}), not evaluated "
              f"(--train-only) -> {train['final']}", flush=True)
    print(f"[vat bench] trained {len(cells)} drafts; rerun without --train-only to evaluate them", flush=True)


def select_cells(cells: list[Cell], only: list[str] | None) -> list[int]:
    """The indices of the cells to run: all, or those whose method or baseline label is in ``only`` (each name must
    label a cell of the bench)."""
    if not only:
        return list(range(len(cells)))
    labels = list(dict.fromkeys(c.method for c in cells))
    for name in only:
        if name not in labels:
            raise VatError(f"--methods: `{name}` is no method or baseline of this bench{closest_hint(name, labels)}")
    return [i for i, c in enumerate(cells) if c.method in only]


def _bench_target(cells: list[Cell], build: bool = True) -> str:
    """The bench's target (the baselines' and every method's without its own ``target``): the one the methods train
    for, else the one the first draft records, else the first method's own target. ``build=False`` names an embedded
    tiny target's directory without building it."""
    def resolve_target_path(path: str) -> str:
        return resolve(path) if build or path not in TINY_TARGET_NAMES else tiny_target_dir(TINY_TARGET_NAMES[path])

    shared = [c for c in cells if c.trained and c.target is None]
    trained = [c for c in shared if c.has_training]
    if trained:
        return resolve_target_path(trained[0].train_cfg.target.path)
    if shared:
        return resolve_target_path(_draft_target(shared, recorded=not build))
    return resolve_target_path(next(c.target for c in cells if c.target is not None))


def _draft_target(cells: list[Cell], recorded: bool = False) -> str:
    """The target a bench of draft cells only evaluates on: the one the first draft records (``target_path``); with
    ``recorded`` (a re-render of a record whose drafts are not here) the one its finished cell's eval.json names."""
    for cell in cells:
        if cell.draft is None:
            continue
        if not os.path.isdir(cell.draft):
            target = _recorded_target(cell) if recorded else None
            if target is not None:
                return target
            raise VatError(f"method {cell.method}: draft {cell.draft} not found (train it first, e.g. with the bench "
                           "that makes it)")
        path = getattr(read_draft_config(cell.draft), "target_path", None)
        if path:
            return path
    raise VatError("no method trains a draft and no draft records its target_path: add a trained method")


def _recorded_target(cell: Cell) -> str | None:
    """The target a finished cell was evaluated on (its eval.json ``target``), None when it has no record."""
    try:
        with open(os.path.join(cell.directory, "eval", "eval.json")) as f:
            return json.load(f).get("target")
    except (OSError, ValueError):
        return None


def main(args: argparse.Namespace) -> int:
    """Entry point of `vat bench`."""
    bench = load_bench_config(resolve_config(args.config), args.overrides)
    if getattr(args, "record", None):
        if args.render:
            run_bench(bench, render_only=True)
        written = write_record(bench, args.record)
        print(f"[vat bench] record of {written['cells']} cells: {written['files']} files, "
              f"{written['bytes'] / 1e6:.2f} MB in {args.record}", flush=True)
        return 0
    only = [m.strip() for m in args.methods.split(",") if m.strip()] if getattr(args, "methods", None) else None
    if args.render and getattr(args, "train_only", False):
        raise VatError("--render runs nothing and --train-only trains: pass one of them")
    run_bench(bench, render_only=args.render, only=only, train_only=getattr(args, "train_only", False))
    return 0


def resolve_config(path: str) -> str:
    """The bench config as given when it exists, else the packaged one it names (``bench/tiny.yaml``)."""
    if os.path.exists(path):
        return path
    try:
        return resolve_recipe(path)
    except Exception:
        return path  # load_bench_config names what the user typed
