"""`vat demo [--quick] [--output DIR]`: the whole pipeline on the embedded tiny MoE target, end to end.

Stages (each cached, so a second run reuses what exists):

1. the tiny OLMoE target (built from ShareGPT on first use);
2. training data: ShareGPT rendered with the target's chat template, plus a subset whose assistant turns the target
   regenerated itself (drafts trained on the target's own outputs accept more);
3. the draft vocabulary;
4. training: the EAGLE-3 baseline and EAGLE-3 + VAT on the same data, steps and seed;
5. evaluation: real speculative decoding on Spec-Bench and HumanEval with chain drafting, with no budget and two
   expert budgets, plus the autoregressive baseline in the same run;
6. ``DIR/report.md`` with the side-by-side tables and the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import dataclass, field

from vat.paths import recipe_path

REPO_RECIPES = recipe_path("tiny")  # packaged, so `vat demo` runs from a wheel too (not only from a clone)


@dataclass
class DemoPlan:
    """Sizes of one demo run (``--quick`` is the same pipeline, smaller)."""

    target: str
    regen_conversations: int
    regen_new_tokens: int
    train_steps: int
    eval_limit: int  # prompts per benchmark (spread over Spec-Bench's categories)
    max_new_tokens: int
    budgets: list[int | None] = field(default_factory=list)
    drafts: dict[str, list[str]] = field(default_factory=dict)
    train_overrides: list[str] = field(default_factory=list)  # applied to every draft's recipe
    # measured stage times on 2 idle CPU cores (s), for the "min left" estimate: target build, data, one draft, eval
    seconds: dict[str, float] = field(default_factory=dict)


def plan_for(quick: bool) -> DemoPlan:
    drafts = {"eagle3": ["eagle3.yaml"], "eagle3+vat": ["eagle3_vat.yaml"]}  # recipe, then overrides
    if quick:
        return DemoPlan(target="tiny-quick", regen_conversations=8, regen_new_tokens=32, train_steps=20,
                        eval_limit=2, max_new_tokens=16, budgets=[None, 6, 4],
                        drafts=drafts, train_overrides=["data.tokens_per_batch=1024", "data.max_length=256"],
                        seconds={"target": 60, "data": 25, "train": 14, "eval": 12})
    return DemoPlan(target="tiny", regen_conversations=48, regen_new_tokens=96, train_steps=160,
                    eval_limit=13, max_new_tokens=48, budgets=[None, 6, 4],
                    drafts=drafts, train_overrides=["data.tokens_per_batch=2048", "data.max_length=512"],
                    seconds={"target": 690, "data": 78, "train": 350, "eval": 205})


class Stages:
    """Prints numbered stage headers with elapsed time and an estimate of what is left.

    ``expected`` holds each stage's time on 2 idle cores (s). The estimate scales what is left by how fast the
    finished stages that did real work went (a stage served from the cache in under a tenth of its expected time
    says nothing about the machine), so a busier or faster machine corrects it after its first real stage.
    """

    def __init__(self, names: list[str], expected: list[float]):
        self.names, self.expected = names, expected
        self.start = time.time()
        self.marks: list[float] = []  # start time of each stage begun
        self.index = 0

    def pace(self, now: float) -> float:
        """Actual / expected time over the finished stages that were not served from the cache (1 without any)."""
        ends = self.marks[1:] + [now]
        worked = [(end - begin, exp) for begin, end, exp in zip(self.marks, ends, self.expected)
                  if end - begin > 0.1 * exp]
        return sum(a for a, _ in worked) / sum(e for _, e in worked) if worked else 1.0

    def next(self) -> None:
        now = time.time()
        pace = self.pace(now)
        remaining = pace * sum(self.expected[self.index:])
        print(f"\n[vat demo {self.index + 1}/{len(self.names)}] {self.names[self.index]} "
              f"({(now - self.start) / 60:.1f} min elapsed, about {remaining / 60:.1f} min left)", flush=True)
        self.marks.append(now)
        self.index += 1


def ensure_demo_data(target_name: str, target_dir: str, plan: DemoPlan, max_length: int = 1024) -> str:
    """ShareGPT prepared for the target plus the target-regenerated subset, concatenated (cached)."""
    from datasets import concatenate_datasets, load_from_disk

    from vat.data_prep.chat import prepare_chat
    from vat.data_prep.regen import Regenerator, regenerate_file
    from vat.defaults import ensure_tiny_data
    from vat.paths import sharegpt_path, vat_home

    out = os.path.join(vat_home(), "data", f"{target_name}-demo-train")
    if os.path.exists(os.path.join(out, "dataset_info.json")):
        return out
    sharegpt = ensure_tiny_data(target_name, max_length=max_length)
    regen_file = os.path.join(vat_home(), "data", f"{target_name}-regen.jsonl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    print(f"[vat] regenerating {plan.regen_conversations} ShareGPT conversations with the target -> {regen_file}")
    regenerate_file(sharegpt_path(), regen_file, Regenerator(model, tokenizer, max_new_tokens=plan.regen_new_tokens),
                    batch_size=8, limit=plan.regen_conversations)
    regen_dir = os.path.join(vat_home(), "data", f"{target_name}-regen")
    parts = [load_from_disk(sharegpt)]
    if os.path.exists(regen_file) and os.path.getsize(regen_file) > 0:
        prepare_chat(regen_file, target_dir, regen_dir, max_length=max_length)
        parts.append(load_from_disk(regen_dir))
    else:
        print("[vat] the target regenerated no usable answer; training on ShareGPT only")
    columns = ["input_ids", "loss_mask", "length", "id"]
    parts = [p.select_columns([c for c in columns if c in p.column_names]) for p in parts]
    combined = concatenate_datasets(parts)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    combined.save_to_disk(tmp)
    os.replace(tmp, out)
    return out


def train_draft(name: str, recipe_and_overrides: list[str], plan: DemoPlan, data: str, vocab: str, out: str) -> str:
    """Train one draft (reused when ``final/`` exists for the same resolved config)."""
    from vat.config import load_config, to_yaml
    from vat.trainer import main as train_main

    recipe, extra = os.path.join(REPO_RECIPES, recipe_and_overrides[0]), recipe_and_overrides[1:]
    run_dir = os.path.join(out, "train", name.replace("+", "_"))
    cfg = load_config(recipe, [
        f"target.path={plan.target}", f"data.train={data}", f"data.vocab={vocab}", f"output_dir={run_dir}",
        f"train.max_steps={plan.train_steps}", *plan.train_overrides, *extra,
    ])
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
    from vat.data_prep.tiny_target import ensure_tiny_target
    from vat.defaults import ensure_draft_vocab
    from vat.eval.run import run_eval
    from vat.paths import tiny_target_dir
    from vat.report import write_demo_report

    plan = plan_for(args.quick)
    out = os.path.abspath(args.output)
    os.makedirs(out, exist_ok=True)
    names = ["embedded tiny MoE target", "training data (ShareGPT + target-regenerated subset)", "draft vocabulary"]
    names += [f"training {name}" for name in plan.drafts]
    names += ["speculative-decoding evaluation (Spec-Bench, HumanEval; budgets none and two smaller)", "report"]
    built = os.path.exists(os.path.join(tiny_target_dir(args.quick), "model.safetensors"))
    sec = plan.seconds
    expected = [1 if built else sec["target"], sec["data"], 1] + [sec["train"]] * len(plan.drafts) + [sec["eval"], 1]
    stages = Stages(names, expected)
    start = time.time()

    stages.next()
    target_dir = ensure_tiny_target(quick=args.quick)
    stages.next()
    data = ensure_demo_data(plan.target, target_dir, plan)
    stages.next()
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(target_dir).vocab_size
    vocab = ensure_draft_vocab(data, vocab_size, _recipe_vocab_size(), os.path.join(out, "vocab"))
    finals = {}
    for name, recipe in plan.drafts.items():
        stages.next()
        finals[name] = train_draft(name, recipe, plan, data, vocab, out)
    stages.next()
    eval_dir = os.path.join(out, "eval")
    results = run_eval(target=target_dir, drafts=[*finals.items(), "none"], benchmarks=["spec_bench", "humaneval"],
                       steps=7, budgets=plan.budgets, max_new_tokens=plan.max_new_tokens, limit=plan.eval_limit,
                       output=eval_dir, device="cpu")
    stages.next()
    report = write_demo_report(out, finals, results, eval_dir, wall_seconds=time.time() - start, quick=args.quick)
    print(f"\n[vat demo] done in {(time.time() - start) / 60:.1f} min. Report: {report}")
    return 0


def _recipe_vocab_size() -> int:
    from vat.config import load_config

    return int(load_config(os.path.join(REPO_RECIPES, "eagle3.yaml")).drafter.draft_vocab_size)
