"""The typed settings of one evaluation: :class:`EvalConfig`, the one place their defaults and choices are stated.

`vat eval`'s flags default to its fields, :func:`vat.eval.run.run_eval` takes one (or its fields as keywords), and a
bench's ``eval`` section and each method's ``eval`` overrides are checked with :func:`check_eval_section` against the
same choices. :func:`check_eval_config` rejects a bad setting in one line before anything loads. The choices of
``tree_policy`` are the eval policy registry's (:mod:`vat.eval.policies.registry`), those of ``policy`` the budget rules
of :data:`vat.target.budget.POLICIES`; a registered policy checks its own settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from vat.config import DEFAULT_BUDGET_POLICY, closest_hint
from vat.errors import VatError
from vat.eval.cost import get_accelerator, served_bytes_of
from vat.eval.ngram import DEFAULT_N_MAX, DEFAULT_N_MIN, RULES
from vat.eval.offload import HOST_LINKS, RESIDENCY_POLICIES, OffloadSpec
from vat.eval.policies import EvalPolicy
from vat.eval.policies.registry import DEFAULT_TREE_POLICY, choices, picked, self_sized
from vat.eval.tree import TreeSpec
from vat.target.budget import POLICIES, RANKS

AR_LABEL = "none"  # the autoregressive baseline's label in every result table
NO_BUDGET = "none"
SELF_SIZED = "auto"  # the budget of a policy that sizes its expert set itself (acceptmoe)


@dataclass
class EvalConfig:
    """Every setting of one evaluation (draft and target aside). Field comments are the reference; `vat eval` flags
    are the field names with dashes (``--benchmark`` and ``--budget`` for the lists)."""

    benchmarks: list[str] = field(default_factory=lambda: ["spec_bench"])  # names or files (load_benchmark)
    steps: int = 7  # chain length K (a DFlash draft drafts its own block_size - 1 per round)
    tree: Optional[str] = None  # dynamic tree "top_k,depth,total_tokens" (None = chain)
    temperature: float = 0.0  # 0 = greedy, > 0 = lossless speculative sampling
    budgets: Any = NO_BUDGET  # "none,8,4" or a list (None = natural routing, "auto" = acceptmoe's self-sized set)
    policy: str = DEFAULT_BUDGET_POLICY  # budget policy: one of vat.target.budget.POLICIES
    budget_rank: str = "weights"  # scores ranking the budget set: weights | routing (DeepSeek-V3's biased; extension)
    vh_threshold: Optional[float] = None  # stop drafting when the verification head's probability falls below
    draft_confidence: Optional[float] = None  # stop a chain after a drafted token the draft gives less than this
    # probability (the token is kept: transformers' assistant_confidence_threshold); None = never
    tree_policy: str = DEFAULT_TREE_POLICY  # how the drafts are chosen: a vat.eval.policies.registry name
    verify_cost: Optional[str] = None  # EVICT's verification-cost profile; None = profiled on the fly
    evict_calibration: Optional[int] = None  # EVICT's calibration prompts (a benchmark's dev split); 0 = raw estimates
    cost_model: Optional[str] = None  # roofline bytes model (h100 | h200 | a100 | l40s[@eta=η,latency_us=µs])
    served_dtype: str = "bfloat16"  # the dtype the cost model prices weights and KV in
    offload: Optional[str] = None  # expert offloading: resident experts per MoE layer, "8,16" (one model per C)
    offload_policy: str = "lru"  # which resident expert a load evicts: lru | lfu (vat.eval.offload)
    offload_link: str = "pcie5"  # host-to-device link: pcie5 (64 GB/s) | c2c (GH200 NVLink-C2C, 450 GB/s)
    ecospec_lambda: float = 1.0  # EcoSpec's λ: nats of draft log-probability one predicted new expert costs
    affinity: Optional[str] = None  # EcoSpec's expert predictor; None = each draft's own affinity.safetensors
    commitment: Optional[str] = None  # AcceptMoE's p̂_d (eval.json or JSON list); None = the prior 0.8^d
    acceptmoe_residency: Optional[int] = None  # AcceptMoE under offload: prune S against a live cache of C experts
    ngram_n: int = DEFAULT_N_MAX  # the `ngram` draft's longest matched suffix (vLLM's prompt_lookup_max)
    ngram_min: int = DEFAULT_N_MIN  # its shortest (vLLM's prompt_lookup_min)
    ngram_rule: str = "vllm"  # which earlier occurrence it copies: vllm (the earliest) | recent (the latest)
    max_new_tokens: int = 256  # tokens generated per turn
    limit: Optional[int] = None  # prompts per benchmark (None = all)
    batch_size: int = 1  # only 1: prompts are decoded one at a time
    seed: int = 0  # seeds every sampled prompt / turn deterministically
    dtype: str = "auto"  # target dtype (auto = bf16 on GPU, fp32 on CPU)
    device: Optional[str] = None  # target device (None = CUDA if available)
    experts_impl: Optional[str] = None  # grouped_mm | eager | batched_mm | triton; None = grouped_mm for a path
    device_map: Optional[str] = None  # e.g. auto: shard the target across the node's GPUs (overrides device)
    reference_cache: Optional[str] = None  # keeps the natural greedy decode of every benchmark between evaluations
    reference_target: Optional[str] = None  # quality against this target's natural output (e.g. a Window Pool
    #   target's base); None = the evaluated target's own. Same tokenizer. Every pass gets quality figures then.


EVAL_DEFAULTS = EvalConfig()
EVAL_FIELDS = tuple(f.name for f in dataclasses.fields(EvalConfig))


def eval_config(base: EvalConfig | None = None, **settings: Any) -> EvalConfig:
    """``base`` (default: the defaults) with ``settings`` replaced; an unknown name stops in one line."""
    for key in settings:
        if key not in EVAL_FIELDS:
            raise VatError(f"unknown eval setting `{key}`{closest_hint(key, list(EVAL_FIELDS))}")
    return dataclasses.replace(base or EvalConfig(), **settings)


def parse_budgets(text: str | None) -> list[int | str | None]:
    """``"none,8,4"`` -> ``[None, 8, 4]`` (order kept, duplicates dropped); ``auto`` = a self-sized set (acceptmoe)."""
    out: list[int | str | None] = []
    for part in str(text or NO_BUDGET).split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part in ("none", "null", "off"):
            value: int | str | None = None
        elif part == SELF_SIZED:
            value = SELF_SIZED
        else:
            try:
                value = int(part)
            except ValueError:
                raise VatError(f"--budget takes a comma list of integers, `none` or `auto`, got `{part}`") from None
            if value < 1:
                raise VatError(f"expert budget must be >= 1, got {value}")
        if value not in out:
            out.append(value)
    return out or [None]


@dataclass
class CheckedEval:
    """An :class:`EvalConfig` after :func:`check_eval_config`: the tree parsed, the budgets listed, the eval policies it
    picks built (:mod:`vat.eval.policies`)."""

    config: EvalConfig
    tree: TreeSpec | None
    budgets: list[int | str | None]
    offload: OffloadSpec | None = None
    policies: list[EvalPolicy] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:  # the config's fields read through (steps, policy, temperature ...)
        return getattr(self.config, name)


def check_eval_config(cfg: EvalConfig) -> CheckedEval:
    """Every setting checked before anything loads: one clear line for the first bad one."""
    if cfg.batch_size != 1:
        raise VatError(f"--batch-size {cfg.batch_size}: vat eval decodes one prompt at a time (batch size 1, as "
                       "EAGLE's and Spec-Bench's speed measurements do); drop the flag")
    if cfg.steps < 1:
        raise VatError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.temperature < 0:
        raise VatError(f"--temperature must be >= 0, got {cfg.temperature}")
    if cfg.draft_confidence is not None and not 0.0 < cfg.draft_confidence <= 1.0:
        raise VatError(f"--draft-confidence must be in (0, 1], got {cfg.draft_confidence}")
    if cfg.ngram_rule not in RULES:
        raise VatError(f"--ngram-rule `{cfg.ngram_rule}`: one of {', '.join(RULES)}")
    tree = TreeSpec.parse(cfg.tree) if isinstance(cfg.tree, str) else cfg.tree
    if cfg.draft_confidence is not None and tree is not None:
        raise VatError("--draft-confidence stops a chain: drop --tree (a tree keeps its nodes by draft probability "
                       "already)")
    budgets = parse_budgets(cfg.budgets) if isinstance(cfg.budgets, str) or cfg.budgets is None else list(cfg.budgets)
    check_eval_section("--", policy=cfg.policy, tree_policy=cfg.tree_policy, cost_model=cfg.cost_model,
                       budget_rank=cfg.budget_rank)
    if cfg.cost_model is not None:
        served_bytes_of(cfg.served_dtype)
    policies = picked(cfg, tree)  # the tree and budget policies' own settings checked
    if SELF_SIZED in budgets and not self_sized(cfg.policy):
        raise VatError(f"--budget {SELF_SIZED} (a self-sized expert set) needs --policy "
                       f"{' | '.join(p for p in POLICIES if self_sized(p))}")
    return CheckedEval(config=cfg, tree=tree, budgets=budgets, offload=_offload(cfg), policies=policies)


def _offload(cfg: EvalConfig) -> OffloadSpec | None:
    """The offload model's settings (None without ``offload``); its knobs alone, or without a cost model, stop."""
    if cfg.offload is None:
        if (cfg.offload_policy, cfg.offload_link) != (EVAL_DEFAULTS.offload_policy, EVAL_DEFAULTS.offload_link):
            raise VatError("--offload-policy / --offload-link set the offload model: add --offload C[,C...]")
        return None
    spec = OffloadSpec.parse(cfg.offload, cfg.offload_policy, cfg.offload_link)
    if cfg.cost_model is None:
        raise VatError("--offload adds host-to-device time to the modeled forwards: add --cost-model (e.g. h200)")
    return spec


def check_eval_section(where: str, *, policy: str | None = None, tree_policy: str | None = None,
                       tree: str | None = None, cost_model: str | None = None, budgets: list | None = None,
                       offload: str | None = None, offload_policy: str | None = None,
                       offload_link: str | None = None, budget_rank: str | None = None) -> None:
    """The choices an evaluation's settings must come from, checked where they are written: ``where`` is ``--`` for
    `vat eval`'s flags, or a bench config section (``eval``, ``methods.<label>.eval``). None = not set there."""
    def bad(name: str, value: Any, need: str) -> VatError:
        if where == "--":
            return VatError(f"--{name.replace('_', '-')} `{value}`: {need}")
        return VatError(f"bad value `{value}` for bench config key `{where}.{name}`: {need}")

    if policy is not None and policy not in POLICIES:
        raise bad("policy", policy, f"one of {', '.join(POLICIES)}")
    if budget_rank is not None and budget_rank not in RANKS:
        raise bad("budget_rank", budget_rank, f"one of {', '.join(RANKS)}")
    if tree_policy is not None and tree_policy not in choices("tree_policy"):
        raise bad("tree_policy", tree_policy, f"one of {', '.join(choices('tree_policy'))}")
    if tree is not None and str(tree).lower() != "chain":
        TreeSpec.parse(tree)
    if cost_model is not None:
        get_accelerator(cost_model)
    if offload_policy is not None and offload_policy not in RESIDENCY_POLICIES:
        raise bad("offload_policy", offload_policy, f"one of {', '.join(RESIDENCY_POLICIES)}")
    if offload_link is not None and offload_link not in HOST_LINKS:
        raise bad("offload_link", offload_link, f"one of {', '.join(HOST_LINKS)}")
    if offload is not None and where != "--":
        try:
            OffloadSpec.parse(offload)
        except VatError:
            raise bad("offload", offload, "a comma list of resident experts per layer, e.g. 8,16") from None
        if cost_model is None:
            raise bad("offload", offload, f"it prices forwards on the cost model: set {where}.cost_model too")
    if budgets is not None and (not budgets or not all(
            b is None or b == SELF_SIZED or (isinstance(b, int) and b >= 1) for b in budgets)):
        raise bad("budgets", list(budgets), "budgets >= 1, null or auto (a self-sized set, policy acceptmoe)")
