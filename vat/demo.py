"""`vat demo [--quick] [--output DIR]`: the whole pipeline on the embedded tiny MoE target, end to end.

Stages (each cached, so a second run reuses what exists):

1. the tiny OLMoE target (built from ShareGPT on first use);
2. training data: the target's own greedy answers to ShareGPT prompts (``data.train: tiny-regen``, what the tiny
   recipes and ``vat bench`` train on: on-policy data, so simulated verification is exact);
3. the draft vocabulary;
4. training: the EAGLE-3 baseline and EAGLE-3 + VAT with the bench's recipes, on the same data, steps and seed;
   the DFlash block drafter + VAT beside them in ``--quick`` (seconds) and with ``--dflash`` in the full demo (about
   +4 min on 2 cores, estimated from the tiny bench's stage times: a DFlash draft trains in 0.77x an EAGLE-3 draft's
   time and block verification evaluates in ~2.3x a chain's);
5. evaluation: real speculative decoding on Spec-Bench and HumanEval (chain drafting K = 7 for EAGLE-3, blocks of 8
   for DFlash: the same 7 drafted tokens per round), with no budget and two expert budgets, beside the
   training-free n-gram draft and the autoregressive baseline in the same run;
6. ``DIR/report.md`` with the side-by-side tables (τ ratios with 95 % paired-bootstrap intervals over prompts) and
   the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig

from vat.config import load_config, to_yaml
from vat.data_prep.tiny_target import ensure_tiny_target
from vat.eval.run import run_eval
from vat.paths import recipe_path, tiny_size, tiny_target_dir
from vat.report import write_demo_report
from vat.train.defaults import ensure_draft_vocab, ensure_tiny_regen_data
from vat.train.kinds import drafter_kind
from vat.train.trainer import main as train_main

REPO_RECIPES = recipe_path("tiny")  # packaged, so `vat demo` runs from a wheel too (not only from a clone)


@dataclass
class DemoPlan:
    """Sizes of one demo run (``--quick`` is the same pipeline, smaller)."""

    target: str
    train_steps: int
    eval_limit: int  # prompts per benchmark (spread over Spec-Bench's categories)
    max_new_tokens: int
    regen_conversations: int  # ShareGPT rows the target answers for the training data (tiny-regen)
    budgets: list[int | None] = field(default_factory=list)
    drafts: dict[str, list[str]] = field(default_factory=dict)  # name -> [recipe, overrides...]; DFlash: no vocab
    train_overrides: list[str] = field(default_factory=list)  # applied to every draft's recipe
    # measured stage times on 2 idle CPU cores (s), for the "min left" estimate: target build, data, one draft, eval
    seconds: dict[str, float] = field(default_factory=dict)


DFLASH_DRAFT = {"dflash+vat": ["dflash_vat.yaml"]}


def plan_for(quick: bool, dflash: bool = False) -> DemoPlan:
    """The demo's sizes; ``quick`` always trains the DFlash + VAT draft too, the full demo only with ``dflash``.

    Both run on the quick tiny target (4.7 M parameters, 16 experts top-4): the full target's build alone (23.6 min
    at 1,059 tokens/s on a slow 2-core machine) would leave no room in 30 min for the drafts, and the drafts' training
    steps are what the demo's comparison needs most (VAT / EAGLE-3 grows from 1.12x at 50 steps to 1.25x at 100 on
    the tiny bench). The full target carries ``vat bench recipes/bench/tiny.yaml``.
    """
    drafts = {"eagle3": ["eagle3.yaml"], "eagle3+vat": ["eagle3_vat.yaml"]}  # recipe, then overrides
    if quick:
        return DemoPlan(target="tiny-quick", train_steps=20,
                        eval_limit=2, max_new_tokens=16, regen_conversations=600, budgets=[None, 6, 4],
                        drafts={**drafts, **DFLASH_DRAFT},
                        train_overrides=["data.tokens_per_batch=1024", "data.max_length=256"],
                        seconds={"target": 89, "data": 20, "train": 15, "eval": 20})
    # the bench's recipe (tiny-regen data, 2048-token batches) on the quick target; stage times measured from nothing
    # on 2 idle cores (docs/RESULTS.md): target build, regeneration, one draft, evaluation (--dflash: x1.46, the
    # tiny bench's block-vs-chain evaluation cost); a slower machine corrects them after the first stage
    return DemoPlan(target="tiny-quick", train_steps=150,
                    eval_limit=13, max_new_tokens=48, regen_conversations=2000, budgets=[None, 6, 4],
                    drafts={**drafts, **(DFLASH_DRAFT if dflash else {})},
                    train_overrides=["data.tokens_per_batch=2048", "data.max_length=256"],
                    seconds={"target": 89, "data": 43, "train": 250, "eval": 140 if dflash else 96})


# seconds of :func:`probe_seconds` on the machine the stage times were measured on (2 idle cores, 2 torch threads)
PROBE_REFERENCE_SECONDS = 0.53  # measured 0.51-0.61 (best of 3, five runs) on 2 idle cores, 2026-12-04


def probe_seconds(repeats: int = 3) -> float:
    """Seconds of a fixed training-like workload (a 2-layer MLP at the tiny drafts' width: forward, backward, AdamW,
    on 2,048 rows), the best of ``repeats``: this machine's speed at the demo's kind of work, in about a second."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 192, generator=gen)
    w1 = torch.randn(192, 768, generator=gen).requires_grad_()
    w2 = torch.randn(768, 192, generator=gen).requires_grad_()
    opt = torch.optim.AdamW([w1, w2], lr=1e-4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(20):
            loss = torch.nn.functional.silu(x @ w1).matmul(w2).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        best = min(best, time.perf_counter() - start)
    return best


class Stages:
    """Prints numbered stage headers with elapsed time and an estimate of what is left.

    ``expected`` holds each stage's time on 2 idle cores (s). The estimate scales what is left by this machine's
    pace: the pace of a one-second probe (:func:`probe_seconds` against :data:`PROBE_REFERENCE_SECONDS`), or how fast
    the finished stages that did real work went when that is slower (a stage served from the cache in under a tenth
    of its expected time says nothing about the machine, and one served partly from it runs faster than the machine
    does; a busier machine shows as stages slower than the probe), so the first estimate already reflects a slower
    machine and each real stage can only correct it upwards.
    """

    def __init__(self, names: list[str], expected: list[float], probe_pace: float = 1.0):
        self.names, self.expected, self.probe_pace = names, expected, probe_pace
        self.start = time.time()
        self.marks: list[float] = []  # start time of each stage begun
        self.index = 0

    def pace(self, now: float) -> float:
        """The probe's pace, or actual / expected time over the finished stages not served from the cache when that
        is slower."""
        ends = self.marks[1:] + [now]
        worked = [(end - begin, exp) for begin, end, exp in zip(self.marks, ends, self.expected)
                  if end - begin > 0.1 * exp]
        measured = sum(a for a, _ in worked) / sum(e for _, e in worked) if worked else 0.0
        return max(self.probe_pace, measured)

    def next(self) -> None:
        now = time.time()
        pace = self.pace(now)
        remaining = pace * sum(self.expected[self.index:])
        print(f"\n[vat demo {self.index + 1}/{len(self.names)}] {self.names[self.index]} "
              f"({(now - self.start) / 60:.1f} min elapsed, about {remaining / 60:.1f} min left)", flush=True)
        self.marks.append(now)
        self.index += 1


def ensure_demo_data(plan: DemoPlan) -> str:
    """The target's own regenerated answers to the plan's first ShareGPT rows, prepared for training: the recipes'
    ``data.train: tiny-regen`` at the plan's size (cached)."""
    return ensure_tiny_regen_data(plan.target, conversations=plan.regen_conversations, max_length=_max_length(plan))


def train_draft(name: str, recipe_and_overrides: list[str], plan: DemoPlan, data: str, vocab: str, out: str) -> str:
    """Train one draft (reused when ``final/`` exists for the same resolved config)."""
    recipe, extra = os.path.join(REPO_RECIPES, recipe_and_overrides[0]), recipe_and_overrides[1:]
    run_dir = os.path.join(out, "train", name.replace("+", "_"))
    cfg = load_config(recipe, [
        f"target.path={plan.target}", f"data.train={data}", f"output_dir={run_dir}",
        f"train.max_steps={plan.train_steps}", *plan.train_overrides, *extra,
    ])
    if not drafter_kind(cfg.drafter.kind).full_vocab:  # a DFlash draft predicts over the target's whole vocabulary
        cfg.data.vocab = vocab
    final = os.path.join(run_dir, "final")
    saved = os.path.join(final, "config.yaml")
    if os.path.exists(saved) and open(saved).read() == to_yaml(cfg):
        print(f"[vat] reusing trained draft {final}")
        return final
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.time()
    train_main(cfg)
    with open(os.path.join(final, "wall_seconds.json"), "w") as f:
        json.dump({"train_seconds": time.time() - start}, f)
    return final


def main(args: argparse.Namespace) -> int:
    """Entry point of `vat demo`."""
    plan = plan_for(args.quick, dflash=getattr(args, "dflash", False))
    out = os.path.abspath(args.output)
    os.makedirs(out, exist_ok=True)
    names = ["embedded tiny MoE target", "training data (the target's own answers to ShareGPT prompts)",
             "draft vocabulary"]
    names += [f"training {name}" for name in plan.drafts]
    names += ["speculative-decoding evaluation (Spec-Bench, HumanEval; budgets none and two smaller)", "report"]
    train_seconds = [sec_for(plan, recipe) for recipe in plan.drafts.values()]
    built = os.path.exists(os.path.join(tiny_target_dir(tiny_size(plan.target)), "model.safetensors"))
    sec = plan.seconds
    expected = [1 if built else sec["target"], sec["data"], 1] + train_seconds + [sec["eval"], 1]
    probe = probe_seconds()
    stages = Stages(names, expected, probe_pace=probe / PROBE_REFERENCE_SECONDS)
    print(f"[vat demo] this machine's pace: {probe / PROBE_REFERENCE_SECONDS:.2f}x the 2-core reference "
          f"(a {probe:.2f} s probe); the estimates below scale with it", flush=True)
    start = time.time()

    stages.next()
    target_dir = ensure_tiny_target(tiny_size(plan.target))
    stages.next()
    data = ensure_demo_data(plan)
    stages.next()

    vocab_size = AutoConfig.from_pretrained(target_dir).vocab_size
    vocab = ensure_draft_vocab(data, vocab_size, _recipe_vocab_size(), os.path.join(out, "vocab"))
    finals = {}
    for name, recipe in plan.drafts.items():
        stages.next()
        finals[name] = train_draft(name, recipe, plan, data, vocab, out)
    stages.next()
    eval_dir = os.path.join(out, "eval")
    results = run_eval(target=target_dir, drafts=[*finals.items(), "ngram", "none"],
                       benchmarks=["spec_bench", "humaneval"],
                       steps=7, budgets=plan.budgets, max_new_tokens=plan.max_new_tokens, limit=plan.eval_limit,
                       output=eval_dir, device="cpu")
    stages.next()
    report = write_demo_report(out, finals, results, eval_dir, wall_seconds=time.time() - start, quick=args.quick)
    print(f"\n[vat demo] done in {(time.time() - start) / 60:.1f} min. Report: {report}")
    return 0


def sec_for(plan: DemoPlan, recipe: list[str]) -> float:
    """Expected training time of one draft: a DFlash draft trains in ~0.77x an EAGLE-3 draft's time (tiny bench:
    5.9 against 7.65 min per 200-step draft)."""
    return plan.seconds["train"] * (0.77 if recipe[0].startswith("dflash") else 1.0)


def _recipe_vocab_size() -> int:
    return int(load_config(os.path.join(REPO_RECIPES, "eagle3.yaml")).drafter.draft_vocab_size)


def _max_length(plan: DemoPlan) -> int:
    """The longest training sample of the plan (its ``data.max_length`` override)."""
    for item in plan.train_overrides:
        if item.startswith("data.max_length="):
            return int(item.split("=", 1)[1])
    return 1024
