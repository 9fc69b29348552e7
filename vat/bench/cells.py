"""The cells of a bench and how each one is trained and evaluated, resumably.

A trained cell is (method, seed): ``cells/<method>/seed<k>/train/`` (a `vat train` run directory) and
``.../eval/eval.json``, plus ``.../curve/step_<N>/eval.json`` for each curve step. A draft cell (a method with
``draft:`` instead of ``recipe:``) evaluates an existing draft directory as it is, per seed (``{seed}`` in its path):
``cells/<method>/seed<k>/eval/eval.json``. A baseline cell (``ngram``, ``none``) is
``cells/<baseline>/eval/eval.json``: training-free drafts do not depend on a seed. Every method may override the
bench's eval settings (tree, tree policy, budgets, budget policy, cost model: ``methods.<label>.eval``), so one
draft evaluated several ways is several methods side by side.

Every stage is reused when its recorded settings match: the draft when ``final/config.yaml`` is the resolved
training config, an evaluation when its ``bench_settings.json`` is the one it would be run with. A killed training
resumes from its newest checkpoint (``resume=auto``). ``cell.json`` is written last, so a cell with a matching
``cell.json`` is finished and is skipped whole.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from vat.config import VatConfig, load_config
from vat.errors import VatError
from vat.eval.config import EVAL_DEFAULTS
from vat.eval.run import run_eval
from vat.export.checkpoint import write_json
from vat.paths import resolve_recipe as packaged_recipe
from vat.target.model import resolve_target_path
from vat.train.checkpointing import list_checkpoints
from vat.train.trainer import main as train_main

CELL_FILE = "cell.json"
SETTINGS_FILE = "bench_settings.json"


@dataclass
class Cell:
    """One unit of work: a method trained with one seed and evaluated, or a training-free baseline evaluated once.

    Attributes:
        method: method or baseline label.
        seed: the training seed; None for a baseline.
        directory: ``output_dir/cells/<method>/seed<k>`` or ``output_dir/cells/<baseline>``.
        train_cfg: the resolved training config (None for a baseline or a draft cell).
        draft: a draft cell's draft directory (placeholders filled), else None.
        target: the method's own target (``methods.<label>.target``, placeholders filled), else None: the bench's.
    """

    method: str
    seed: int | None
    directory: str
    train_cfg: Any = None
    draft: str | None = None
    target: str | None = None

    def target_dir(self, bench_target: str) -> str:
        """The target directory this cell trains and evaluates on: its method's own, else the bench's."""
        if self.target is None:
            return bench_target

        return resolve_target_path(self.target)

    @property
    def trained(self) -> bool:
        """A seeded cell (a method: trained here, or an existing draft of that seed), not a baseline."""
        return self.seed is not None

    @property
    def has_training(self) -> bool:
        return self.train_cfg is not None

    @property
    def name(self) -> str:
        return f"{self.method} seed {self.seed}" if self.trained else self.method


# ---- planning -------------------------------------------------------------------------------------------------------


def resolve_recipe(name: str) -> str:
    """A recipe path as given when it exists, else the packaged recipe it names (``tiny/eagle3.yaml``)."""
    path = packaged_recipe(name)
    if not os.path.isfile(path):
        raise VatError(f"recipe not found: {name} (looked at it as given and among vat's recipes)")
    return path


def train_config(bench: Any, label: str, seed: int, directory: str) -> Any:
    """The resolved training config of one cell.

    Overrides, later wins: the bench's ``train_overrides`` (shared), the method's own, then what the bench needs:
    the seed, the cell's output directory, ``resume=auto`` (a killed cell continues), one metrics line per step
    (training tokens are summed from them) and, with a curve, a checkpoint at every curve step, all kept.
    """
    method = bench.methods[label]
    forced = [f"seed={seed}", f"output_dir={os.path.join(directory, 'train')}", "resume=auto", "train.log_every=1"]
    bench_dir = os.path.dirname(os.path.dirname(os.path.dirname(directory)))  # directory = bench_dir/cells/label/seedK
    overrides = [fill_placeholders(o, seed, bench_dir) for o in [*bench.train_overrides, *method.overrides]]
    own = method_target(method, seed, bench_dir)
    if own is not None:  # the method's own target wins over any target.path override
        overrides.append(f"target.path={own}")
    cfg = load_config(resolve_recipe(method.recipe), [*overrides, *forced])
    steps = sorted(set(bench.curve.steps))
    if steps:
        total = cfg.train.max_steps
        if total is None:
            raise VatError(f"method {label}: curve.steps needs train.max_steps (set it in train_overrides)")
        if steps[-1] > total:
            raise VatError(f"curve step {steps[-1]} is past method {label}'s train.max_steps {total}")
        inner = [s for s in steps if s < total]  # the last step is final/, not a checkpoint
        if inner:
            cfg.train.save_every = math.gcd(*inner)
        cfg.train.keep_last = 0
    return cfg


def method_target(method: Any, seed: int, bench_dir: str) -> str | None:
    """A method's own target (``methods.<label>.target``, placeholders filled; an existing relative directory made
    absolute, read from the cwd like a draft path; a tiny or hub name as it is), or None."""
    if not method.get("target"):
        return None
    own = fill_placeholders(method.target, seed, bench_dir)
    return os.path.abspath(own) if os.path.isdir(own) else own


def fill_placeholders(override: str, seed: int, bench_dir: str) -> str:
    """An override with ``{seed}`` (the cell's seed) and ``{bench_dir}`` (the bench's output directory) filled in.

    So a method can start from another method's draft of the same seed:
    ``train.init_from={bench_dir}/cells/eagle3/seed{seed}/train/final``.
    """
    return override.replace("{seed}", str(seed)).replace("{bench_dir}", bench_dir)


def plan_cells(bench: Any, out: str) -> list[Cell]:
    """Every cell in run order: seed by seed (all methods), the baselines right after the first seed.

    That order makes a partial bench useful early: after the first seed's cells, every method and baseline has a
    figure on the same prompts.

    Raises:
        VatError: the methods train against different targets (their ratios would mean nothing).
    """
    cells: list[Cell] = []
    for i, seed in enumerate(bench.seeds):
        for label, method in bench.methods.items():
            directory = os.path.join(out, "cells", label, f"seed{seed}")
            own = method_target(method, int(seed), out)
            if method.get("draft"):
                draft = os.path.abspath(fill_placeholders(method.draft, int(seed), out))  # relative: to the cwd
                cells.append(Cell(label, int(seed), directory, draft=draft, target=own))
                continue
            cells.append(Cell(label, int(seed), directory, train_config(bench, label, int(seed), directory),
                              target=own))
        if i == 0:
            cells += [Cell(base, None, os.path.join(out, "cells", base)) for base in bench.baselines]
    targets = {c.train_cfg.target.path for c in cells if c.has_training and c.target is None}
    if len(targets) > 1:
        raise VatError(f"the bench's methods train for different targets {sorted(targets)}; set target.path in "
                       "train_overrides (or methods.<label>.target for a method meant to run on another target)")
    return cells


def check_same_training(cells: list[Cell]) -> list[str]:
    """Warnings for methods whose data or step count differ at the same seed (the bench compares like with like).

    Continuations (``train.init_from``) are compared with each other: their extra steps, not their total, must match.
    """
    warnings, first = [], {}
    for cell in (c for c in cells if c.has_training):
        cfg = cell.train_cfg
        key = (cfg.data.train, cfg.data.max_length, cfg.data.tokens_per_batch, cfg.data.limit, cfg.train.max_steps)
        ref = first.setdefault((cell.seed, bool(cfg.train.get("init_from"))), (cell.method, key))
        if ref[1] != key:
            warnings.append(f"{cell.name} trains on data/steps {key}, {ref[0]} on {ref[1]}: not the same training")
    return warnings


# ---- fingerprints ------------------------------------------------------------------------------------------------


def config_identity(cfg: Any) -> str | None:
    """A training config as YAML, less what does not change the draft, or None.

    Left out: ``logging`` (trackers, progress bars), ``output_dir`` and ``resume`` (a bench directory copied
    elsewhere keeps its cells), ``train.stop_after`` (where a process stops, not what it
    computes: a run stopped there resumes to the same numbers) and every key at vat's default for the
    config's method (:func:`method_defaults`: the method's preset applied). So a key
    that a newer vat adds with a default that keeps the old behaviour (``train.init_from``, ``train.lora``) leaves the
    drafts and cells of earlier runs valid; a key a run sets away from its default is always part of the identity.

    Args:
        cfg: a config object, or the path of a saved ``config.yaml``.
    """
    if isinstance(cfg, str):
        if not os.path.exists(cfg):
            return None
        try:
            cfg = OmegaConf.load(cfg)
        except Exception:  # a torn file: not the same config
            return None
    data = OmegaConf.to_container(cfg, resolve=True)
    for where in ("logging", "output_dir", "resume"):  # where a run writes and how it restarts, not what it computes
        data.pop(where, None)
    data.get("train", {}).pop("stop_after", None)
    method = str(data.get("method", "eagle3"))
    kept = {"method": method, **_without_defaults(data, method_defaults(method))}  # the method always names itself
    return OmegaConf.to_yaml(OmegaConf.create(kept))


@functools.cache
def method_defaults(method: str) -> dict:
    """vat's default training config for ``method`` as a dict, its preset applied (what a recipe setting nothing
    gets)."""
    try:
        cfg = load_config(None, [f"method={method}"])
    except Exception:  # a method this vat no longer knows: compare against the plain defaults
        cfg = OmegaConf.structured(VatConfig)
    return OmegaConf.to_container(cfg, resolve=True)


def _without_defaults(data: dict, defaults: Any) -> dict:
    """``data`` less every key whose value equals ``defaults``' (nested sections compared key by key)."""
    out = {}
    for key, value in data.items():
        default = defaults.get(key, _MISSING) if isinstance(defaults, dict) else _MISSING
        if isinstance(value, dict):
            inner = _without_defaults(value, default if isinstance(default, dict) else {})
            if inner:
                out[key] = inner
        elif value != default:
            out[key] = value
    return out


_MISSING = object()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# eval keys beside the original six, with the value that leaves `vat eval` as it was: a setting at its default is
# left out of the settings (and so of every fingerprint), so benches that never set one keep their finished cells
EVAL_VARIANT_DEFAULTS = {key: getattr(EVAL_DEFAULTS, key)
                         for key in ("tree", "tree_policy", "verify_cost", "evict_calibration", "policy",
                                     "vh_threshold", "cost_model", "offload", "offload_policy", "offload_link",
                                     "commitment", "acceptmoe_residency", "budget_rank", "ecospec_lambda",
                                     "affinity", "draft_confidence")}


def method_eval(bench: Any, method: str | None) -> dict:
    """The eval settings of one method: the bench's ``eval.*`` with the method's ``eval`` overrides on top (a
    baseline, or None: the bench's). ``tree: chain`` in an override means no tree."""
    ev = bench.eval
    out = {"steps": ev.steps, "budgets": list(ev.budgets),
           **{key: ev.get(key, default) for key, default in EVAL_VARIANT_DEFAULTS.items()}}
    spec = bench.methods.get(method) if method is not None else None
    if spec is not None:
        for key, value in (spec.get("eval") or {}).items():
            if value is not None:
                out[key] = list(value) if key == "budgets" else value
    if out["tree"] is not None and str(out["tree"]).lower() == "chain":
        out["tree"] = None
    return out


def eval_settings(bench: Any, *, curve: bool = False, method: str | None = None) -> dict:
    """What an evaluation depends on besides the draft (a curve point: the curve's subset and the first budget).

    The original keys always; the eval variants (:data:`EVAL_VARIANT_DEFAULTS`) only when away from their default.
    """
    ev = bench.eval
    mine = method_eval(bench, method)
    settings = {
        "benchmarks": list(ev.benchmarks), "limit": bench.curve.limit if curve else ev.limit,
        "max_new_tokens": ev.max_new_tokens, "steps": mine["steps"], "temperature": ev.temperature,
        "budgets": [mine["budgets"][0]] if curve else list(mine["budgets"]),
    }
    settings.update({k: mine[k] for k, default in EVAL_VARIANT_DEFAULTS.items() if mine[k] != default})
    return settings


def draft_identity(path: str) -> str | None:
    """An existing draft, hashed: its path, its config files and its weights' size (None when it is missing)."""
    parts = [os.path.normpath(path)]
    found = False
    for name in ("config.yaml", "config.json", "model.safetensors"):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        found = True
        if name.endswith(".safetensors"):
            parts.append(f"{name}:{os.path.getsize(file)}")
        else:
            with open(file) as f:
                parts.append(f"{name}:{_sha(f.read())}")
    return _sha("|".join(parts)) if found else None


INPUT_FILE_KEYS = ("commitment", "affinity")  # eval settings that name a file the evaluation reads


def input_identity(bench: Any, cell: Cell) -> dict:
    """``{"inputs": {key: hash}}``: the contents of the files a cell's evaluation reads besides its draft (AcceptMoE's
    ``commitment``, EcoSpec's ``affinity``), so a file refitted under the same path runs the cell again. ``{}`` when
    none is set, so cells without such files keep their fingerprints and recorded settings."""
    settings = cell_eval_settings(bench, cell)
    hashes = {}
    for key in INPUT_FILE_KEYS:
        path = settings.get(key)
        if not path:
            continue
        try:
            with open(path, "rb") as f:
                hashes[key] = hashlib.sha256(f.read()).hexdigest()[:16]
        except OSError:
            hashes[key] = "missing"
    return {"inputs": hashes} if hashes else {}


def cell_fingerprint(bench: Any, cell: Cell, target: str) -> str:
    """Everything a finished cell's figures depend on, hashed: a change means the cell runs again (the files its
    evaluation reads included, by content)."""
    parts = {"target": target, "eval": eval_settings(bench, method=cell.method), **input_identity(bench, cell)}
    if cell.has_training:
        parts["train"] = _sha(config_identity(cell.train_cfg))
        parts["curve"] = {"steps": sorted(set(bench.curve.steps)), **eval_settings(bench, curve=True,
                                                                                   method=cell.method)}
    elif cell.draft is not None:
        parts["draft"] = draft_identity(cell.draft)
    return _sha(json.dumps(parts, sort_keys=True))


def recorded(cell: Cell) -> dict | None:
    """The cell's record as it was written (with its eval.json), whatever settings it ran with; None when absent.
    What ``vat bench --render`` reads: a committed bench's cells, whose drafts and targets are not at hand."""
    record = _read_json(os.path.join(cell.directory, CELL_FILE))
    return record if record and os.path.exists(eval_path(cell)) else None


def finished(cell: Cell, fingerprint: str, bench: Any = None, target: str | None = None) -> dict | None:
    """The cell's record when it finished with these settings, else None.

    A trained cell whose record carries another fingerprint still counts when what it ran can be checked against
    what is wanted now (``bench`` and ``target`` given): its draft's saved training config has the same identity
    (:func:`config_identity`: vat's defaults left out) and its evaluations ran with the wanted settings. Its record
    then takes the current fingerprint. So records of an earlier vat, whose identity kept every default, stay valid.
    """
    path = os.path.join(cell.directory, CELL_FILE)
    record = _read_json(path)
    if not record or not os.path.exists(eval_path(cell)):
        return None
    if record.get("fingerprint") == fingerprint:
        return record
    if bench is not None and target is not None and cell.has_training and _ran_as_wanted(bench, cell, target, record):
        record["fingerprint"] = fingerprint
        write_json(path, record)
        return record
    return None


def _ran_as_wanted(bench: Any, cell: Cell, target: str, record: dict) -> bool:
    """A trained cell's draft and evaluations, read from its files, are the ones its current settings ask for."""
    steps = sorted(set(bench.curve.steps))
    if [p.get("step") for p in record.get("curve") or []] != steps:
        return False
    run_dir = cell.train_cfg.output_dir
    saved = config_identity(os.path.join(run_dir, "final", "config.yaml"))
    if saved is None:  # a copied record without its draft (docs/bench/*/cells): the run's own config
        saved = config_identity(os.path.join(run_dir, "config.yaml"))
    if saved is None or saved != config_identity(cell.train_cfg):
        return False

    inputs = input_identity(bench, cell)

    def ran_with(directory: str, settings: dict) -> bool:
        recorded = _read_json(os.path.join(directory, SETTINGS_FILE)) or {}
        recorded.pop("train", None)  # the hash of the identity as the earlier vat wrote it
        recorded.pop("step", None)
        return recorded == {"target": target, **settings, "drafts": [cell.method], **inputs}

    if not ran_with(os.path.join(cell.directory, "eval"), eval_settings(bench, method=cell.method)):
        return False
    curve = eval_settings(bench, curve=True, method=cell.method)
    return all(ran_with(os.path.join(cell.directory, "curve", f"step_{step}"), curve) for step in steps)


def report_dir(output_dir: str, name: str) -> str:
    """Where a bench writes bench.json, bench.md, its PNGs and its config: ``output_dir`` itself, unless another bench
    (another ``name`` in its bench_config.yaml) reports there, as when benches share their cells; then
    ``output_dir/benches/<name>``, so no bench overwrites another's record. Cells always live in ``output_dir/cells``.
    """
    path = os.path.join(output_dir, "bench_config.yaml")
    if os.path.isfile(path):
        owner = OmegaConf.load(path).get("name")
        if owner not in (None, name):
            return os.path.join(output_dir, "benches", name)
    return output_dir


def eval_path(cell: Cell) -> str:
    return os.path.join(cell.directory, "eval", "eval.json")


# ---- stages -------------------------------------------------------------------------------------------------------


def train_stage(cfg: Any) -> dict:
    """Train (or reuse, or resume) one draft; returns its figures.

    Returns:
        ``final`` (the draft dir), ``seconds`` (training wall time, steps run before a kill included), ``steps``,
        ``tokens`` (training tokens), ``final_tau_sim``, ``resumed_from_step``, ``reused``.
    """
    run_dir = cfg.output_dir
    final = os.path.join(run_dir, "final")
    wanted = config_identity(cfg)
    reused = config_identity(os.path.join(final, "config.yaml")) == wanted
    wall, resumed = 0.0, 0
    if not reused:
        if config_identity(os.path.join(run_dir, "config.yaml")) not in (None, wanted):
            shutil.rmtree(run_dir)  # another config's checkpoints must not be resumed
        found = list_checkpoints(run_dir)
        resumed = found[-1][0] if found else 0
        start = time.time()
        train_main(cfg)
        wall = time.time() - start
        if not os.path.exists(os.path.join(final, "config.yaml")):
            raise VatError(f"training in {run_dir} stopped before writing final/ (train.stop_after?); rerun the "
                           "bench without it to continue from the last checkpoint")
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    previous = _read_json(os.path.join(run_dir, "bench_train.json")) or {}
    if reused:
        seconds = float(previous.get("seconds", 0.0))
    else:
        # a resumed run's earlier steps ran in a killed process: their step times come from the metrics log
        seconds = wall + sum(r["tokens"] / r["tokens_per_s"] for r in records
                             if r["step"] <= resumed and r.get("tokens_per_s"))
        write_json(os.path.join(run_dir, "bench_train.json"), {"seconds": seconds, "resumed_from_step": resumed})
    last = records[-1] if records else {}
    return {"final": final, "seconds": seconds, "steps": int(last.get("step", 0)),
            "tokens": sum(r.get("tokens", 0.0) for r in records), "final_tau_sim": last.get("tau_sim"),
            "resumed_from_step": previous.get("resumed_from_step", resumed) if reused else resumed, "reused": reused}


def read_metrics(path: str) -> list[dict]:
    """The training's metrics.jsonl records (one per step), in step order."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["step"])


def tokens_until(records: list[dict], step: int) -> float:
    """Training tokens seen up to and including ``step``."""
    return float(sum(r.get("tokens", 0.0) for r in records if r["step"] <= step))


def prune_checkpoints(run_dir: str, keep_steps: list[int]) -> None:
    """Drop the checkpoints no curve point reads, once the draft is final (they exist only for resuming)."""
    if not os.path.exists(os.path.join(run_dir, "final")):
        return
    for step, path in list_checkpoints(run_dir):
        if step not in keep_steps:
            shutil.rmtree(path, ignore_errors=True)


def eval_stage(directory: str, drafts: list, target: str, settings: dict, identity: dict, progress: bool,
               reference_cache: str | None = None) -> dict:
    """Evaluate drafts with the real engine into ``directory`` (reused when its recorded settings match).

    Args:
        directory: the evaluation's output directory.
        drafts: ``run_eval`` draft specs: ``(label, path)`` pairs or training-free names (``ngram``, ``none``).
        target: the target directory.
        settings: :func:`eval_settings`.
        identity: what identifies the drafts (their training configs' hashes), recorded with the settings.
        progress: show the engine's progress bars.
        reference_cache: where the natural greedy decode of the prompts is kept between cells (the quality
            reference of budgeted runs, :mod:`vat.eval.reference_cache`).

    Returns:
        The eval.json dict, with ``bench_seconds`` (0 when reused) and ``bench_reused``.
    """
    recorded = {"target": target, **settings, **identity}
    path = os.path.join(directory, "eval.json")
    result = _read_json(path)
    if result and "per_prompt" in result and _read_json(os.path.join(directory, SETTINGS_FILE)) == recorded:
        return {**result, "bench_seconds": 0.0, "bench_reused": True}
    start = time.time()
    variants = {key: settings.get(key, default) for key, default in EVAL_VARIANT_DEFAULTS.items()}
    result = run_eval(target=target, drafts=drafts, benchmarks=list(settings["benchmarks"]), steps=settings["steps"],
                      temperature=settings["temperature"], budgets=list(settings["budgets"]),
                      max_new_tokens=settings["max_new_tokens"], limit=settings["limit"], output=directory,
                      progress=progress, plots=False, autoregressive=False, reference_cache=reference_cache,
                      **variants)  # AR is its own cell
    write_json(os.path.join(directory, SETTINGS_FILE), recorded)
    return {**result, "bench_seconds": time.time() - start, "bench_reused": False}


def reference_cache_dir(bench: Any) -> str:
    """Where a bench keeps the natural greedy decode of its prompts (every budgeted cell's quality reference)."""
    return os.path.join(os.path.abspath(bench.output_dir), "natural_reference")


# ---- one cell -----------------------------------------------------------------------------------------------------


def run_cell(bench: Any, cell: Cell, target: str, fingerprint: str, progress: bool) -> dict:
    """Train (if a method) and evaluate one cell, then write its ``cell.json``; returns that record."""
    os.makedirs(cell.directory, exist_ok=True)
    record: dict[str, Any] = {"method": cell.method, "seed": cell.seed, "fingerprint": fingerprint}
    settings = cell_eval_settings(bench, cell)
    inputs = input_identity(bench, cell)
    cache = reference_cache_dir(bench)
    if not cell.trained:
        result = eval_stage(os.path.join(cell.directory, "eval"), [cell.method], target, settings,
                            {"drafts": [cell.method], **inputs}, progress, cache)
        record["eval"] = _eval_summary(result, cell.method, bench)
    elif cell.draft is not None:
        identity = {"drafts": [cell.method], "draft": draft_identity(cell.draft), **inputs}
        if identity["draft"] is None:
            raise VatError(f"method {cell.method}: draft {cell.draft} not found (train it first, e.g. with the bench "
                           "that makes it)")
        result = eval_stage(os.path.join(cell.directory, "eval"), [(cell.method, cell.draft)], target, settings,
                            identity, progress, cache)
        record["eval"] = _eval_summary(result, cell.method, bench)
        record["draft"] = cell.draft
    else:
        train = train_stage(cell.train_cfg)
        record["train"] = {k: v for k, v in train.items() if k != "final"}
        identity = {"drafts": [cell.method], "train": _sha(config_identity(cell.train_cfg)), **inputs}
        result = eval_stage(os.path.join(cell.directory, "eval"), [(cell.method, train["final"])], target,
                            settings, identity, progress, cache)
        record["eval"] = _eval_summary(result, cell.method, bench)
        record["curve"] = _curve(bench, cell, train, target, identity, progress)
        prune_checkpoints(cell.train_cfg.output_dir, sorted(set(bench.curve.steps)))
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_json(os.path.join(cell.directory, CELL_FILE), record)
    return record


def cell_eval_settings(bench: Any, cell: Cell) -> dict:
    """:func:`eval_settings` of one cell, with ``{seed}`` and ``{bench_dir}`` filled in the paths that take them (an
    AcceptMoE ``commitment`` read from another cell's eval.json, an EcoSpec ``affinity`` fitted per seed's draft)."""
    settings = eval_settings(bench, method=cell.method)
    bench_dir = os.path.dirname(os.path.dirname(os.path.dirname(cell.directory)))  # bench_dir/cells/label/seedK
    for key in ("commitment", "affinity"):
        if settings.get(key):
            settings[key] = fill_placeholders(settings[key], cell.seed, bench_dir)
    return settings


def _eval_summary(result: dict, label: str, bench: Any) -> dict:
    """The figures a progress line and ``cell.json`` show: seconds and τ per benchmark under the first budget."""
    first = method_eval(bench, label)["budgets"][0]
    budget = "none" if first is None else str(first)
    per_bench = result.get("results", {}).get(label, {}).get(budget, {})
    return {"seconds": result["bench_seconds"], "reused": result["bench_reused"],
            "tau": {name: m.get("tau") for name, m in per_bench.items()}}


def _curve(bench: Any, cell: Cell, train: dict, target: str, identity: dict, progress: bool) -> list[dict]:
    """τ of the checkpoints at the curve steps, on the curve's prompt subset (pooled over benchmarks)."""
    points = []
    records = read_metrics(os.path.join(cell.train_cfg.output_dir, "metrics.jsonl"))
    first = method_eval(bench, cell.method)["budgets"][0]
    budget = "none" if first is None else str(first)
    for step in sorted(set(bench.curve.steps)):
        draft = train["final"] if step == cell.train_cfg.train.max_steps else os.path.join(
            cell.train_cfg.output_dir, "checkpoints", f"step_{step}")
        directory = os.path.join(cell.directory, "curve", f"step_{step}")
        if not os.path.isdir(draft) and not os.path.exists(os.path.join(directory, "eval.json")):
            raise VatError(f"{cell.name}: checkpoint {draft} for curve step {step} is missing; delete "
                           f"{cell.train_cfg.output_dir} to retrain the cell")
        result = eval_stage(directory, [(cell.method, draft)], target,
                            eval_settings(bench, curve=True, method=cell.method), {**identity, "step": step}, progress,
                            reference_cache_dir(bench))
        pooled = result.get("pooled", {}).get(cell.method, {}).get(budget, {})
        per_bench = result.get("results", {}).get(cell.method, {}).get(budget, {})
        points.append({"step": step, "tokens": tokens_until(records, step), "tau": pooled.get("tau"),
                       "tau_per_benchmark": {name: m.get("tau") for name, m in per_bench.items()},
                       "seconds": result["bench_seconds"]})
    return points
