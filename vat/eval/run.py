"""`vat eval`: real speculative decoding over benchmarks, per draft x expert budget; eval.json, report, plots.

Entry points: :func:`main` (the CLI: setup -> run -> write) and :func:`run_eval` (programmatic, plain arguments,
returns the eval.json dict). The autoregressive baseline (draft ``none``) always runs once per benchmark with natural
routing, on the same prompts in the same process: it is the denominator of ``speedup_vs_ar``. The training-free n-gram
draft (``ngram``, :mod:`vat.eval.ngram`) is a draft like a trained one: a chain of ``steps`` tokens, every budget.
Budgets apply to the verification forwards of the drafts only (docs/eval.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from vat.drafters.dflash import DFlashDrafter, check_dflash_matches_target
from vat.drafters.eagle3 import Eagle3Drafter, check_draft_matches_target
from vat.errors import VatError
from vat.eval.benchmarks import load_benchmark
from vat.eval.config import (
    AR_LABEL,
    EVAL_FIELDS,
    NO_BUDGET,
    CheckedEval,
    EvalConfig,
    check_eval_config,
    eval_config,
)
from vat.eval.cost import CostModel, add_costs, get_accelerator, pooled_cost, served_bytes_of, target_shape
from vat.eval.engine import SpeculativeEngine
from vat.eval.free_drafts import is_free_draft, parse_free_draft
from vat.eval.metrics import PromptRun, by_category, prompt_counts, prompt_totals, set_speedups, summarize
from vat.eval.ngram import NgramSpec
from vat.eval.offload import add_offload, pooled_offload
from vat.eval.offload import describe as describe_offload
from vat.eval.policies import EvalPolicy, PolicySetup
from vat.eval.policies.registry import default_budget, run_record, settings_record
from vat.eval.prompts import decode, eos_token_ids, render_chat
from vat.eval.quality import (
    add_counts,
    empty_counts,
    response_kl,
    sequence_agreement,
    stepwise_agreement,
    summarize_quality,
)
from vat.eval.reference_cache import load_reference, reference_key, save_reference
from vat.eval.report import markdown_summary, write_outputs
from vat.eval.suffix import SuffixSpec
from vat.eval.tree import TreeSpec
from vat.export.checkpoint import load_draft
from vat.target import BudgetSpec, FrozenTarget, load_target

EVAL_FORMAT_VERSION = 1


@dataclass
class DraftEntry:
    """One draft to evaluate: its label, where it came from, the loaded model (an ``Eagle3Drafter``, a
    ``DFlashDrafter``, an :class:`NgramSpec`, or None = AR) and its aux layers."""

    label: str
    path: str | None
    model: Any = None
    aux_layer_ids: list[int] | None = None
    vh_threshold: float | None = None
    draft_confidence: float | None = None  # an EAGLE-3 chain's confidence stop

    @property
    def is_free(self) -> bool:
        """A training-free draft (n-gram or suffix decoding)."""
        return is_free_draft(self.model)

    @property
    def is_block(self) -> bool:
        return isinstance(self.model, DFlashDrafter)


@dataclass
class RunConfig:
    """One pass over a benchmark: a draft (or AR) under one budget."""

    draft: DraftEntry
    budget: int | str | None  # None = natural routing, "auto" = self-sized (acceptmoe)

    @property
    def budget_label(self) -> str:
        return NO_BUDGET if self.budget is None else str(self.budget)


def _draft_label(path: str, taken: set[str]) -> str:
    parts = os.path.normpath(path).split(os.sep)
    label = "/".join(parts[-2:]) if len(parts) > 1 and (parts[-1] == "final" or parts[-1].startswith("step")) else parts[-1]
    base, i = label, 1
    while label in taken or label == AR_LABEL:
        i += 1
        label = f"{base}#{i}"
    taken.add(label)
    return label


# ---- loading ----------------------------------------------------------------------------------------------------------


def _load_drafts(drafts: list[Any], ngram: NgramSpec) -> list[DraftEntry]:
    entries, taken = [], set()
    for i, spec in enumerate(drafts):
        label = None
        if isinstance(spec, tuple):
            label, spec = spec
        if spec is None or (isinstance(spec, str) and spec.lower() == AR_LABEL):
            continue
        model = spec if is_free_draft(spec) else parse_free_draft(spec, ngram) if isinstance(spec, str) else None
        if model is not None:
            name = label or (spec if isinstance(spec, str) else model.label)
            entries.append(DraftEntry(label=_draft_label(name, taken), path=None, model=model))
            continue
        if isinstance(spec, (Eagle3Drafter, DFlashDrafter)):
            entries.append(DraftEntry(label=_draft_label(label or f"draft{i}", taken), path=None, model=spec))
            continue
        path = str(spec)
        model, _ = load_draft(path)
        entries.append(DraftEntry(label=_draft_label(label or path, taken), path=path, model=model))
    return entries


def _load_target(target: Any, drafts: list[DraftEntry], dtype: str, device: str | None, ngram: bool = False,
                 experts_impl: str | None = None, device_map: str | None = None):
    """The target: given, or the one the first trained draft records. ``drafts``: the trained entries only.

    Loaded with the trainer's loader (:func:`vat.target.load_target`); ``experts_impl`` None = ``grouped_mm`` for a
    path, the target's own for a loaded :class:`FrozenTarget` (switched when another is asked for).
    """
    if isinstance(target, FrozenTarget):
        if experts_impl is not None and experts_impl != target.experts_impl:
            target.set_experts_impl(experts_impl)
        return target
    first_ids = drafts[0].model.config.aux_layer_ids if drafts else None
    if target is None:
        paths = [d.model.config.target_path for d in drafts if d.model.config.target_path]
        if not paths and ngram and not drafts:
            raise VatError("--draft ngram needs --target: no trained draft names one (`--target tiny` = the embedded "
                           "default)")
        if not paths:
            raise VatError("no --target given and no draft records the target it was trained for")
        if len(set(paths)) > 1:
            warnings.warn(f"drafts were trained for different targets {sorted(set(paths))}; using {paths[0]}", stacklevel=2)
        target = paths[0]
    return load_target(target, dtype=dtype, device=device, aux_layer_ids=first_ids,
                       experts_impl=experts_impl or "grouped_mm", device_map=device_map)


def _attach(drafts: list[DraftEntry], target, vh_threshold: float | None) -> None:
    """Check each trained draft against the target, give it the target's embedding (and a DFlash draft its LM head),
    device and dtype."""
    with_vh = [d for d in drafts if d.model.verification_head is not None]
    if vh_threshold is not None and not drafts:
        # only the n-gram draft / AR: nothing has a head; a caller sweeping one setting over every cell gets on
        warnings.warn("--vh-threshold ignored: no trained draft to apply it to", stacklevel=2)
    if vh_threshold is not None and drafts and not with_vh:
        raise VatError("--vh-threshold needs a draft with a verification head; none of the drafts has one")
    for d in drafts:
        cfg = d.model.config
        check = check_dflash_matches_target if d.is_block else check_draft_matches_target
        d.aux_layer_ids = check(cfg, target.hidden_size, target.vocab_size, target.num_layers)
        d.model.set_embedding(target.embed_tokens().weight)
        if d.is_block:
            d.model.set_lm_head(target.lm_head().weight)
        d.model.to(device=target.device, dtype=target.dtype).eval()
        if vh_threshold is not None and d.model.verification_head is None:
            warnings.warn(f"draft {d.label} has no verification head: --vh-threshold ignored for it", stacklevel=2)
        else:
            d.vh_threshold = vh_threshold


def _attach_confidence(drafts: list[DraftEntry], confidence: float | None) -> None:
    """Give every EAGLE-3 draft the chain's confidence stop; a DFlash draft (one block per round) stops in one line."""
    if confidence is None:
        return
    blocks = [d.label for d in drafts if d.is_block]
    if blocks:
        raise VatError(f"--draft-confidence stops an EAGLE-3 chain; {', '.join(blocks)} draft one DFlash block per "
                       "round (truncate it with --vh-threshold)")
    for d in drafts:
        d.draft_confidence = confidence


def _load_tokenizer(tokenizer: Any, target) -> Any:
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer

    path = tokenizer or target.path
    if not path:
        raise VatError("the target was given as a model object: pass its tokenizer too")
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise VatError(f"cannot load the tokenizer of `{path}`: {str(err).splitlines()[0]}") from None


# ---- decoding ---------------------------------------------------------------------------------------------------------


def _fits(tokenizer, prompt, max_new_tokens: int, block: int, max_positions: int | None) -> bool:
    """Whether the whole conversation (every turn answered with max_new_tokens) fits the target's positions."""
    if not max_positions:
        return True
    messages = []
    for turn in prompt.turns:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
    length = len(render_chat(tokenizer, messages[:-1])) + len(prompt.turns) * (max_new_tokens + 8)
    return length + block <= max_positions


def _generator(device: torch.device, seed: int, index: int, turn: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + index * 7919 + turn)
    return gen


def _decode_prompt(engine, tokenizer, prompt, index: int, seed: int) -> tuple[PromptRun, list[list[int]], list[str]]:
    """Every turn of one prompt; the model's own answer goes back before the next user turn."""
    messages: list[dict[str, str]] = []
    gens, ids, texts, prompts_ids = [], [], [], []
    for turn, question in enumerate(prompt.turns):
        messages.append({"role": "user", "content": question})
        prompt_ids = render_chat(tokenizer, messages)
        prompts_ids.append(list(prompt_ids))
        gen = engine.generate(prompt_ids, _generator(engine.target.device, seed, index, turn))
        text = decode(tokenizer, gen.token_ids)
        messages.append({"role": "assistant", "content": text})
        gens.append(gen)
        ids.append(gen.token_ids)
        texts.append(text)
    run = PromptRun(question_id=prompt.question_id, category=prompt.category, turns=gens, prompt_ids=prompts_ids)
    return run, ids, texts


def _engine(target, config: RunConfig, *, steps, tree, temperature, policy, max_new_tokens, eos,
            policies: list[EvalPolicy] = (), record_experts: bool = False, hooks: list | None = None):
    """The engine of one pass, with the round hooks the eval policies give this draft under this budget (or exactly
    ``hooks`` when given)."""
    drafter = config.draft.model
    if config.draft.aux_layer_ids is not None:
        target.aux_layer_ids = list(config.draft.aux_layer_ids)  # the features this draft reads
    eagle = drafter is not None and not config.draft.is_free and not config.draft.is_block
    if hooks is None:
        hooks = [h for p in policies if (h := p.for_pass(config.draft, config.budget)) is not None]
    return SpeculativeEngine(
        target, drafter, steps=steps, tree=tree if eagle else None, temperature=temperature,
        budget=config.budget, policy=policy, vh_threshold=config.draft.vh_threshold,
        draft_confidence=config.draft.draft_confidence if eagle else None, policies=hooks,
        max_new_tokens=max_new_tokens, eos_token_ids=eos, record_experts=record_experts,
    )


def _run_config(engine, tokenizer, prompts, config: RunConfig, benchmark: str, temperature: float, seed: int,
                out_file, progress: bool, expert_bytes_per_layer: list[int]) -> list[PromptRun]:
    warm = render_chat(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
    saved, engine.max_new_tokens = engine.max_new_tokens, min(4, engine.max_new_tokens)
    engine.generate(warm, _generator(engine.target.device, seed, -1, 0))  # warm-up, not timed
    engine.max_new_tokens = saved
    engine.start_pass()  # the warm-up's answer is not an earlier response of the pass, nor its experts resident
    runs = []
    desc = f"{benchmark} | {config.draft.label} | B={config.budget_label}"
    for index, prompt in enumerate(tqdm(prompts, desc=desc, disable=not progress, leave=False)):
        run, ids, texts = _decode_prompt(engine, tokenizer, prompt, index, seed)
        runs.append(run)
        if out_file is not None:
            out_file.write(json.dumps({
                "question_id": prompt.question_id, "category": prompt.category, "benchmark": benchmark,
                "draft": config.draft.label, "budget": config.budget_label, "temperature": temperature,
                "token_ids": ids, "text": texts, **prompt_counts(run, expert_bytes_per_layer),
            }) + "\n")
            out_file.flush()
    return runs


# ---- the programmatic entry point -------------------------------------------------------------------------------


def run_eval(
    *,
    target: Any = None,
    drafts: list[Any] | tuple = (AR_LABEL,),
    config: EvalConfig | None = None,
    output: str | None = None,
    tokenizer: Any = None,
    progress: bool = True,
    plots: bool = True,
    autoregressive: bool = True,
    **settings: Any,
) -> dict:
    """Evaluate drafts by real speculative decoding; write ``output/`` when given; return the eval.json dict.

    Args:
        target: target path (``tiny`` for the embedded one), a loaded ``FrozenTarget`` or model; None = the path the
            first draft records (``target_path``).
        drafts: draft directories (vat ``final/``, SGLang or speculators EAGLE-3 exports, DFlash drafts in the DFlash
            release layout), ``Eagle3Drafter`` / ``DFlashDrafter`` objects, free drafts by name (``ngram``,
            ``ngram-vllm-1-3``, ``suffix``: :mod:`vat.eval.free_drafts`; an :class:`NgramSpec` works too) or ``none``
            (the AR baseline always runs); a ``(label, draft)`` pair names the draft in every output (default: its
            directory).
        config: the evaluation's settings (:class:`vat.eval.config.EvalConfig`; None = its defaults).
        output: directory for eval.json, generations.jsonl, report.md and PNGs (None = write nothing).
        tokenizer: tokenizer object or path (default: the target's directory).
        progress: show tqdm bars.
        plots: write the PNGs (with ``output``).
        autoregressive: also decode every prompt autoregressively (the ``speedup_vs_ar`` denominator); False skips
            that pass unless ``none`` is among ``drafts`` (``vat bench`` measures AR once, as its own cell).
        **settings: :class:`EvalConfig` fields replacing the config's (``steps=3, budgets="none,8"``); an unknown
            name stops in one line.

    Returns:
        The eval.json dict (schema in ``docs/eval.md``).
    """
    checked = check_eval_config(eval_config(config, **settings))
    cfg = checked.config
    start = time.time()
    run = _set_up(target, drafts, checked, tokenizer=tokenizer, autoregressive=autoregressive, progress=progress)
    collected = _Collected()
    gen_file = None
    if output:
        os.makedirs(output, exist_ok=True)
        gen_file = open(os.path.join(output, "generations.jsonl"), "w")
    saved_aux_ids = list(run.target.aux_layer_ids)  # each draft sets the features it reads; restored below
    try:
        for spec in cfg.benchmarks:
            _evaluate_benchmark(run, spec, cfg.limit, gen_file, collected)
    finally:
        run.target.aux_layer_ids = saved_aux_ids
        if gen_file is not None:
            gen_file.close()
    result = _result(run, collected, _settings_record(run), seconds=time.time() - start)
    if output:
        write_outputs(result, output, plots=plots)
    return result


@dataclass
class _Run:
    """What every benchmark of one ``run_eval`` shares: the loaded target, tokenizer and drafts, the passes to run
    (draft x budget), the cost model and the eval policies the config picked (set up once, told each benchmark's
    prompts)."""

    settings: CheckedEval
    target: Any
    tok: Any
    eos: Any
    entries: list[DraftEntry]
    configs: list[RunConfig]
    block: int  # the longest verification block: which prompts fit
    max_positions: int | None
    bytes_per_layer: list[int]
    cost: Any
    policies: list[EvalPolicy]
    max_new_tokens: int
    seed: int
    progress: bool
    reference_cache: str | None
    reference_target: Any = None  # the model the quality figures compare with (None: the evaluated target)


@dataclass
class _Collected:
    """What the benchmarks' passes add up to, in eval.json's layout."""

    results: dict[str, dict[str, dict]] = dataclasses.field(default_factory=dict)  # label -> budget -> bench -> metrics
    per_prompt: dict[str, dict[str, dict[str, list]]] = dataclasses.field(default_factory=dict)
    all_runs: dict[tuple[str, str], list[PromptRun]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    bench_names: list[str] = dataclasses.field(default_factory=list)
    quality_reference: dict[str, dict] = dataclasses.field(default_factory=dict)  # where the natural output came from
    pooled_quality: dict[tuple[str, str], dict[str, float]] = dataclasses.field(default_factory=dict)
    examples: dict[str, dict] = dataclasses.field(default_factory=dict)  # the first prompt and its first answer
    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # what load_benchmark read each one from


def _set_up(target, drafts, settings: CheckedEval, *, tokenizer, autoregressive: bool, progress: bool) -> _Run:
    """Load the drafts, the target and its tokenizer; list the passes (the AR pass first when it runs)."""
    cfg = settings.config
    entries = _load_drafts(list(drafts), NgramSpec(n_max=cfg.ngram_n, n_min=cfg.ngram_min, rule=cfg.ngram_rule))
    eagle = [d for d in entries if not d.is_free]
    target_obj = _load_target(target, eagle, cfg.dtype, cfg.device, ngram=len(eagle) < len(entries),
                              experts_impl=cfg.experts_impl, device_map=cfg.device_map)
    if settings.offload is not None:  # C against the target's k and E, before anything decodes
        settings.offload.check(target_obj.num_experts, target_obj.top_k)
    _attach(eagle, target_obj, cfg.vh_threshold)
    _attach_confidence(eagle, cfg.draft_confidence)
    tok = _load_tokenizer(tokenizer, target_obj)
    # the AR pass is the denominator of speedup_vs_ar; a caller that measures AR once elsewhere (vat bench) skips it
    # unless `none` is asked for by name
    asked_ar = any(isinstance(d, str) and d.lower() == AR_LABEL for d in drafts)
    configs = [RunConfig(DraftEntry(AR_LABEL, None), None)] if autoregressive or asked_ar or not entries else []
    configs += [RunConfig(d, b) for d in entries for b in settings.budgets]
    cost = _cost_model(target_obj, settings.cost_model, settings.served_dtype)
    block = 1 + max([_drafted_per_round(d, settings.steps, settings.tree) for d in entries] or [0])  # n-gram: steps
    eos = eos_token_ids(tok, target_obj.model)

    def engine_for(draft: DraftEntry, hooks: list) -> SpeculativeEngine:  # a policy's own decoding, natural routing
        return _engine(target_obj, RunConfig(draft, None), steps=settings.steps, tree=settings.tree,
                       temperature=settings.temperature, policy=settings.policy, max_new_tokens=cfg.max_new_tokens,
                       eos=eos, hooks=hooks)

    for policy in settings.policies:  # before anything decodes: a missing predictor stops here
        policy.setup(PolicySetup(target=target_obj, tok=tok, drafts=eagle, cost=cost,
                                 max_new_tokens=cfg.max_new_tokens, block=block, engine=engine_for))
    return _Run(
        settings=settings, target=target_obj, tok=tok, eos=eos, entries=entries,
        configs=configs, block=block, max_positions=getattr(target_obj.config, "max_position_embeddings", None),
        bytes_per_layer=target_obj.expert_bytes_per_layer(), cost=cost, policies=settings.policies,
        max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, progress=progress, reference_cache=cfg.reference_cache,
        reference_target=_load_reference_target(cfg, target_obj),
    )


def _load_reference_target(cfg: EvalConfig, target: FrozenTarget) -> FrozenTarget | None:
    """``--reference-target``: the model whose natural greedy output and distribution the quality figures compare
    with, loaded like the target (same dtype and device); it must share the target's vocabulary."""
    if cfg.reference_target is None:
        return None
    reference = load_target(cfg.reference_target, dtype=cfg.dtype, device=cfg.device,
                            experts_impl=cfg.experts_impl or "grouped_mm")
    if reference.config.vocab_size != target.config.vocab_size:
        raise VatError(f"--reference-target {cfg.reference_target}: vocabulary of {reference.config.vocab_size} tokens, "
                       f"the target's has {target.config.vocab_size}; the quality reference must share its tokenizer")
    return reference


def _benchmark_prompts(run: _Run, spec: str, limit: int | None, out: _Collected) -> tuple[str, list]:
    """A benchmark's name (with its category filter, unique in this run) and the prompts that fit the target."""
    loaded = load_benchmark(spec, limit=limit)
    name = loaded[0].benchmark
    base = spec.rsplit("@", 1)[0] if not os.path.exists(spec) else spec  # the split is in the name already
    if not os.path.exists(spec) and ":" in base and not base.startswith("hf:"):
        name += ":" + base.rsplit(":", 1)[1]  # a category filter
    name = _unique(name, out.bench_names)
    prompts = [p for p in loaded if _fits(run.tok, p, run.max_new_tokens, run.block, run.max_positions)]
    out.skipped[name] = {"too_long": len(loaded) - len(prompts)}
    return name, prompts


def _evaluate_benchmark(run: _Run, spec: str, limit: int | None, gen_file, out: _Collected) -> None:
    """Every pass (draft x budget) over one benchmark's prompts, then the quality of the budgeted passes (of every
    pass, with a reference target)."""
    s = run.settings
    name, prompts = _benchmark_prompts(run, spec, limit, out)
    if not prompts:
        warnings.warn(f"benchmark {name}: every prompt is too long for the target; skipped", stacklevel=3)
        return
    out.bench_names.append(name)
    out.sources[name] = os.path.abspath(spec) if os.path.exists(spec) else spec
    for policy in run.policies:  # e.g. EVICT's profile, on the fly from the first benchmark's first prompts
        policy.start_benchmark(prompts, spec)
    bench_runs: dict[int, list[PromptRun]] = {}
    for index, config in enumerate(run.configs):
        bench_runs[index] = _evaluate_pass(run, config, name, prompts, gen_file, out)
    first = bench_runs[0][0]  # the first configuration's answer to the first prompt: what was predicted
    out.examples[name] = {"question": prompts[0].turns[0], "answer": decode(run.tok, first.turns[0].token_ids),
                          "draft": run.configs[0].draft.label, "budget": run.configs[0].budget_label}
    other = run.reference_target  # quality against another model's natural output: every pass is compared
    natural = run.target if other is None else other
    cache = None
    if run.reference_cache is not None and s.temperature == 0:
        cache = (run.reference_cache, *reference_key(natural, run.tok, name, prompts,
                                                     max_new_tokens=run.max_new_tokens, eos=run.eos))
    if other is not None or any(c.budget is not None for c in run.configs):
        own = other is None  # the evaluated target's own lossless runs are its natural output; another's are not
        reference, source, ref_seconds = _natural_reference(
            natural, run.configs if own else [], bench_runs if own else {}, run.tok, prompts,
            temperature=s.temperature, seed=run.seed, policy=s.policy, max_new_tokens=run.max_new_tokens,
            eos=run.eos, steps=s.steps, progress=run.progress, cache=cache)
        if not own:
            source = f"{source} of the reference target {other.path}"
        out.quality_reference[name] = {"source": source, "seconds": ref_seconds,
                                       "target": natural.path}
        _add_quality(run.target, run.configs, bench_runs, reference, name, out.results, out.per_prompt,
                     out.pooled_quality, steps=s.steps, tree_spec=s.tree, policy=s.policy,
                     greedy=s.temperature == 0, source=source, progress=run.progress, policies=run.policies,
                     natural_target=other)
    elif cache is not None and (lossless := _lossless_run(run.configs, bench_runs)) is not None:
        save_reference(*cache, lossless[0])  # for a later budgeted run of the same prompts


def _evaluate_pass(run: _Run, config: RunConfig, name: str, prompts: list, gen_file,
                   out: _Collected) -> list[PromptRun]:
    """One draft under one budget over one benchmark: its metrics, per-prompt counts and (with a cost model) costs."""
    s = run.settings
    E = run.target.num_experts
    engine = _engine(run.target, config, steps=s.steps, tree=s.tree, temperature=s.temperature, policy=s.policy,
                     max_new_tokens=run.max_new_tokens, eos=run.eos, policies=run.policies,
                     record_experts=s.offload is not None)
    runs = _run_config(engine, run.tok, prompts, config, name, s.temperature, run.seed, gen_file, run.progress,
                       run.bytes_per_layer)
    metrics = summarize(runs, run.bytes_per_layer, E)
    metrics["categories"] = by_category(runs, run.bytes_per_layer, E)
    label, budget = config.draft.label, config.budget_label
    out.results.setdefault(label, {}).setdefault(budget, {})[name] = metrics
    # benchmark prompt order, the same for every draft and budget: runs pair by index (`vat bench`)
    out.per_prompt.setdefault(label, {}).setdefault(budget, {})[name] = [
        prompt_totals(r, run.bytes_per_layer) for r in runs
    ]
    if run.cost is not None:
        add_costs(run.cost, engine, runs, metrics, out.per_prompt[label][budget][name])
    if s.offload is not None:
        add_offload(s.offload, run.cost, runs, metrics, out.per_prompt[label][budget][name], E)
    out.all_runs.setdefault((label, budget), []).extend(runs)
    return runs


def _pooled(run: _Run, out: _Collected) -> dict[str, dict[str, dict]]:
    """Metrics over every benchmark per (draft, budget), and every speed-up over the AR pass of the same prompts."""
    E = run.target.num_experts
    pooled: dict[str, dict[str, dict]] = {}
    for (label, budget), runs in out.all_runs.items():
        pooled.setdefault(label, {})[budget] = summarize(runs, run.bytes_per_layer, E)
        entries = [e for per in out.per_prompt[label][budget].values() for e in per]
        if run.cost is not None:
            pooled[label][budget]["cost"] = pooled_cost(entries)
        if run.settings.offload is not None:
            pooled[label][budget]["offload"] = pooled_offload(run.settings.offload, entries)
        if (label, budget) in out.pooled_quality:
            pooled[label][budget]["quality"] = summarize_quality(
                out.pooled_quality[(label, budget)], run.settings.temperature == 0,
                "; ".join(sorted({r["source"] for r in out.quality_reference.values()})))
    ar = out.results.get(AR_LABEL, {}).get(NO_BUDGET, {})
    for label, per_budget in out.results.items():
        for budget, per_bench in per_budget.items():
            for name, metrics in per_bench.items():
                set_speedups(metrics, ar.get(name))
            set_speedups(pooled[label][budget], pooled.get(AR_LABEL, {}).get(NO_BUDGET))
    return pooled


def _settings_record(run: _Run) -> dict:
    """eval.json's ``settings``: how the passes ran (a policy's own knobs only where that policy ran)."""
    s, cfg = run.settings, run.settings.config
    return {
        "mode": "tree" if s.tree is not None else "chain", "steps": cfg.steps,
        "tree": None if s.tree is None else vars(s.tree), "temperature": cfg.temperature,
        "budgets": [NO_BUDGET if b is None else b for b in s.budgets], "policy": cfg.policy,
        "budget_rank": cfg.budget_rank, "vh_threshold": cfg.vh_threshold, "max_new_tokens": cfg.max_new_tokens, "limit": cfg.limit, "batch_size": 1,
        "seed": cfg.seed, "tree_policy": cfg.tree_policy, **settings_record(cfg, s.policies),
        "cost_model": None if cfg.cost_model is None else run.cost.accelerator.name,
        "served_dtype": cfg.served_dtype if cfg.cost_model is not None else None,
        "reference_target": cfg.reference_target,
        **({"draft_confidence": cfg.draft_confidence} if cfg.draft_confidence is not None else {}),
        "offload": None if s.offload is None else list(s.offload.capacities),
        "offload_policy": None if s.offload is None else s.offload.policy,
        "offload_link": None if s.offload is None else s.offload.link,
    }


def _result(run: _Run, out: _Collected, settings: dict, *, seconds: float) -> dict:
    """The eval.json dict (schema in docs/eval.md)."""
    return {
        "vat_eval_version": EVAL_FORMAT_VERSION,
        "target": run.target.path,
        "target_info": _target_info(run, run.settings.config.device_map),
        "settings": settings,
        "cost_model": run.cost.describe() if run.settings.cost_model is not None else None,
        "offload": describe_offload(run.settings.offload) if run.settings.offload is not None else None,
        **run_record(run.policies),  # each registered policy's keys (EVICT's evict_profile), None unless it ran
        "drafts": {
            **({AR_LABEL: {"path": None, "mode": "ar", "verification_head": False, "vh_threshold": None}}
               if any(c.draft.label == AR_LABEL for c in run.configs) else {}),
            **{d.label: _draft_record(d, run.settings.tree, run.policies) for d in run.entries},
        },
        "benchmarks": out.bench_names,
        "benchmark_sources": out.sources,
        "skipped": out.skipped,
        "quality_reference": out.quality_reference,
        "examples": out.examples,
        "results": out.results,
        "pooled": _pooled(run, out),
        "per_prompt": out.per_prompt,
        "seconds": seconds,
    }


def _target_info(run: _Run, device_map: str | None) -> dict:
    target = run.target
    return {
        "num_experts": target.num_experts, "top_k": target.top_k, "moe_layer_ids": list(target.moe_layer_ids),
        "expert_bytes_per_layer": run.bytes_per_layer, "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device), "device_map": device_map, "experts_impl": target.experts_impl,
    }


def _lossless_run(configs: list[RunConfig], bench_runs: dict[int, list[PromptRun]]
                  ) -> tuple[list[PromptRun], str] | None:
    """A greedy run at natural routing of this benchmark (the AR pass or a draft at budget none) and its label."""
    for index, config in enumerate(configs):
        if config.budget is None and index in bench_runs:
            return bench_runs[index], config.draft.label
    return None


def _natural_reference(target, configs: list[RunConfig], bench_runs: dict[int, list[PromptRun]], tok, prompts, *,
                       temperature: float, seed: int, policy: str, max_new_tokens: int, eos, steps: int,
                       progress: bool, cache: tuple[str, str, dict] | None = None
                       ) -> tuple[list[PromptRun], str, float]:
    """The natural greedy decode of every prompt, the reference of the quality figures.

    At temperature 0 a run at natural routing (the AR pass, or any draft at ``--budget none``: greedy speculative
    decoding is lossless) already is it, at no cost; so is a cached one (``cache`` = ``(directory, key, key parts)``
    of :mod:`vat.eval.reference_cache`, which the first two also fill). Otherwise — a bench cell without the AR pass
    and without ``none`` among its budgets, or sampling — one extra autoregressive greedy pass per prompt produces
    it (the cost of an AR baseline, recorded in ``quality_reference``; stored in the cache when there is one).
    """
    if temperature == 0:
        lossless = _lossless_run(configs, bench_runs)
        if lossless is not None:
            if cache is not None:
                save_reference(*cache, lossless[0])
            return lossless[0], f"{lossless[1]} at budget none (lossless greedy)", 0.0
        if cache is not None:
            cached = load_reference(cache[0], cache[1])
            if cached is not None and len(cached) == len(prompts):
                return cached, f"natural greedy decode (cached: {cache[1]})", 0.0
    engine = _engine(target, RunConfig(DraftEntry(AR_LABEL, None), None), steps=steps, tree=None, temperature=0.0,
                     policy=policy, max_new_tokens=max_new_tokens, eos=eos)
    start = time.perf_counter()
    runs = [_decode_prompt(engine, tok, p, i, seed)[0]
            for i, p in enumerate(tqdm(prompts, desc="natural greedy reference", disable=not progress, leave=False))]
    seconds = time.perf_counter() - start
    if cache is not None:  # greedy only: run_eval builds no cache key when sampling
        save_reference(*cache, runs)
    return runs, "natural greedy decode (extra AR pass)", seconds


def _add_quality(target, configs: list[RunConfig], bench_runs: dict[int, list[PromptRun]],
                 reference: list[PromptRun], bench: str, results: dict, per_prompt: dict, pooled_quality: dict, *,
                 steps: int, tree_spec: TreeSpec | None, policy: str, greedy: bool, source: str,
                 progress: bool, policies: list[EvalPolicy] = (), natural_target=None) -> None:
    """Quality figures of every budgeted config on one benchmark (:mod:`vat.eval.quality`): ``quality`` in its
    metrics and in each ``per_prompt`` entry (the counts, summed over turns), pooled counts in ``pooled_quality``.
    With a ``natural_target`` (the reference is its output) every config, natural routing included, is compared
    with it: agreement, stepwise agreement and KL all against that model."""
    judge = target if natural_target is None else natural_target  # whose greedy choices stepwise agreement counts
    compared = [(i, c) for i, c in enumerate(configs)
                if (c.budget is not None or natural_target is not None) and i in bench_runs]
    window = {i: 1 + _drafted_per_round(c.draft, steps, tree_spec) for i, c in compared}  # the verification block
    specs = {_kl_key(c, window[i], policies): _kl_spec(c, window[i], policy, policies) for i, c in compared}
    # KL on the reference text (the natural output): one natural + one target forward per distinct spec, per turn
    kl: list[list[dict]] = []
    for ref in tqdm(reference, desc=f"{bench} | KL to natural", disable=not progress, leave=False):
        kl.append([response_kl(target, p, g.token_ids, specs, natural_target=natural_target)
                   for p, g in zip(ref.prompt_ids, ref.turns)])
    for i, config in compared:
        key = _kl_key(config, window[i], policies)
        total = empty_counts()
        entries = per_prompt[config.draft.label][config.budget_label][bench]
        for run, ref, ref_kl, entry in zip(bench_runs[i], reference, kl, entries):
            counts = empty_counts()
            for turn, gen in enumerate(run.turns):
                if turn >= len(ref.turns):
                    break
                agree = sequence_agreement(gen.token_ids, ref.turns[turn].token_ids)
                if greedy:  # one natural forward over the budgeted turn
                    agree.update(stepwise_agreement(judge, run.prompt_ids[turn], gen.token_ids))
                kl_sum, kl_count = ref_kl[turn][key]
                add_counts(counts, {**agree, "turns": 1, "kl_sum": kl_sum, "kl_count": kl_count})
            entry["quality"] = counts
            add_counts(total, counts)
        results[config.draft.label][config.budget_label][bench]["quality"] = summarize_quality(total, greedy, source)
        add_counts(pooled_quality.setdefault((config.draft.label, config.budget_label), empty_counts()), total)


def _cost_model(target, cost_model: str | None, served_dtype: str) -> CostModel | None:
    """The ``--cost-model`` priced at the served dtype (None without one; a policy that needs one builds its own)."""
    if cost_model is None:
        return None
    return CostModel(get_accelerator(cost_model), target_shape(target), served_bytes_of(served_dtype))


def _kl_key(config: RunConfig, window: int, policies: list[EvalPolicy]) -> tuple:
    """What a budgeted config's KL to natural depends on: (B, window), plus what the policies add (AcceptMoE's p̂)."""
    return (config.budget, window) + tuple(x for p in policies for x in p.kl_key(config.draft))


def _kl_spec(config: RunConfig, window: int, policy: str, policies: list[EvalPolicy]) -> BudgetSpec:
    """The budget of a budgeted config's KL forward: its verification forwards' spec, through the same policy hooks."""
    spec = BudgetSpec(B=config.budget, policy=policy, window=window)
    for p in policies:
        hook = p.for_pass(config.draft, config.budget)
        if hook is not None:
            spec = hook.budget_spec(spec)
    return spec


def _drafted_per_round(d: DraftEntry, steps: int, tree_spec: TreeSpec | None) -> int:
    """The most drafts one verification block of this draft holds."""
    if d.is_block:
        return d.model.config.block_size - 1
    return steps if tree_spec is None or d.is_free else tree_spec.total_tokens


def _draft_record(d: DraftEntry, tree_spec: TreeSpec | None, policies: list[EvalPolicy]) -> dict:
    """The eval.json ``drafts`` entry of one draft (with what the policies record of it: EcoSpec's predictor,
    AcceptMoE's p̂)."""
    record = _mode_record(d, tree_spec)
    for policy in policies:
        record.update(policy.draft_record(d))
    return record


def _mode_record(d: DraftEntry, tree_spec: TreeSpec | None) -> dict:
    if d.is_free:
        settings = dataclasses.asdict(d.model)  # n-gram: n_max, n_min, rule; suffix: max_depth, ... (no rule)
        return {"path": None, "mode": "ngram", "free_draft": "suffix" if isinstance(d.model, SuffixSpec) else "ngram",
                "name": d.model.label, **settings, "verification_head": False, "vh_threshold": None}
    if d.is_block:
        return {"path": d.path, "mode": "block", "block_size": d.model.config.block_size,
                "verification_head": d.model.verification_head is not None, "vh_threshold": d.vh_threshold}
    record = {"path": d.path, "mode": "tree" if tree_spec is not None else "chain",
              "verification_head": d.model.verification_head is not None, "vh_threshold": d.vh_threshold}
    if d.draft_confidence is not None:  # recorded where set: records of runs without it stay as they were
        record["draft_confidence"] = d.draft_confidence
    return record


def _unique(name: str, taken: list[str]) -> str:
    out, i = name, 1
    while out in taken:
        i += 1
        out = f"{name}#{i}"
    return out


def _default_budgets(budget: str | None, policy: str) -> str:
    """``--budget`` as given; unset = the budget policy's default (``auto`` under ``--policy acceptmoe``: it needs no
    B), else ``none``."""
    if budget is not None:
        return budget
    return default_budget(policy) or NO_BUDGET


# `vat eval` flags whose name differs from the EvalConfig field they set (the rest are the field's name)
FLAG_FIELDS = {"benchmark": "benchmarks", "budget": "budgets"}


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The :class:`EvalConfig` of `vat eval`'s parsed flags (a flag the parser lacks keeps the field's default)."""
    values = {FLAG_FIELDS.get(name, name): value for name, value in vars(args).items()}
    settings = {name: values[name] for name in EVAL_FIELDS if name in values}
    settings["benchmarks"] = values.get("benchmarks") or list(EvalConfig().benchmarks)
    settings["budgets"] = _default_budgets(values.get("budgets"), settings.get("policy", EvalConfig().policy))
    return eval_config(**settings)


def main(args: argparse.Namespace) -> int:
    """Entry point of `vat eval` (setup -> run -> write)."""
    result = run_eval(target=args.target, drafts=args.draft or [AR_LABEL], config=config_from_args(args),
                      output=args.output)
    print(markdown_summary(result))
    print(f"wrote {os.path.join(args.output, 'eval.json')}, generations.jsonl, report.md and plots")
    return 0
