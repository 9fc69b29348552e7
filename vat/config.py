"""Typed configuration: dataclass schemas, YAML recipes and dotted CLI overrides (OmegaConf structured, strict).

A recipe is a YAML file whose keys are a subset of :class:`VatConfig`; overrides are ``key.sub=value`` strings
applied at the entry point only. An unknown key stops at once with one line naming it and the closest valid key;
a value of the wrong type names the key and the expected type.

``method`` is a preset for the loss switches (``eagle3`` = the canonical EAGLE-3 baseline, ``vat`` = verification-aware
training); every ``loss.*`` switch left at ``null`` takes the preset's value, so each ablation is one override.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from vat.errors import VatError
from vat.paths import resolve_recipe

# expert-budget policies (vat.target.budget applies them): what a recipe's budget.policy takes, and the default of
# every place that takes a policy (training, vat eval, vat profile, bench, Window Pool); acceptmoe is eval only
TRAINING_BUDGET_POLICIES = ("substitute", "truncate", "truncate_cover")
DEFAULT_BUDGET_POLICY = "substitute"
TRAINING_ATTENTION = ("auto", "dense", "blockwise", "flex")  # the drafters' training attention (drafter.attention)


@dataclass
class TargetConfig:
    path: str = "tiny"  # HF path or dir; `tiny` = the embedded default ($VAT_HOME/tiny-target, built on demand)
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    experts_impl: str = "grouped_mm"  # grouped_mm (transformers default; 5x eager on CPU) | eager | triton (vat.kernels)
    aux_layer_ids: Optional[list[int]] = None  # 0-indexed layer OUTPUTS; null = EAGLE-3 default [1, L//2-1, L-4]
    device_map: Optional[str] = None  # e.g. "auto" to shard a large target inside one node


@dataclass
class DataConfig:
    train: str = "tiny"  # prepared dataset dir (`vat prep chat`); `tiny` = ShareGPT prepared for the tiny target
    vocab: Optional[str] = None  # draft vocab .safetensors (`vat prep vocab`); null = built from the data
    max_length: int = 1024  # longer samples are skipped (counted in stats)
    tokens_per_batch: int = 8192  # length-bucketed batches hold at most this many (padded) tokens
    max_batch_size: int = 16
    limit: Optional[int] = None  # use at most this many samples
    shuffle: bool = True
    capture: Optional[str] = None  # `vat prep capture` dir of data.train: the target's features read from it, not computed


@dataclass
class DrafterConfig:
    kind: str = "eagle3"  # eagle3 | dflash
    draft_vocab_size: int = 32000
    hidden_size: Optional[int] = None  # null = the target's hidden size
    intermediate_size: Optional[int] = None  # null = the target's dense intermediate size (or 4x hidden)
    num_attention_heads: Optional[int] = None  # null = the target's
    num_key_value_heads: Optional[int] = None
    num_layers: int = 1  # EAGLE-3: 1; DFlash: several
    ttt_steps: int = 7  # EAGLE-3 training-time-test unroll K
    block_size: int = 16  # DFlash block: the anchor + block_size - 1 drafted tokens (8 for the tiny target)
    num_anchors: int = 512  # DFlash: random anchors (one block each) per sequence, from loss-masked positions
    mask_token_id: Optional[int] = None  # DFlash: null = the target tokenizer's MASK token (added if it has none)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    verification_head: Optional[bool] = None  # null = from method (vat: on)
    vh_input: str = "normed"  # what the verification head reads: normed (what the LM head reads) | prenorm (residual)
    rope_theta: Optional[float] = None
    # the training forward's attention (same numbers every way): auto = blockwise on CPU, dense elsewhere | dense (one
    # SDPA call, a dense mask) | blockwise (shared keys + each query's own) | flex (flex_attention block masks, CUDA)
    attention: str = "auto"


@dataclass
class LossConfig:
    decay: float = 0.8  # EAGLE-3 base weight w_k = decay^k
    dflash_gamma: Optional[float] = None  # DFlash base weight exp(-(k-1)/gamma); null = 7 (block 16) scaled
    soft_weight: Optional[float] = None  # soft CE against the target distribution on the draft vocab; null = from method
    hard_weight: Optional[float] = None  # hard CE on the target's argmax; null = from method
    adaptive_weights: Optional[bool] = None  # verification-adaptive weighting; null = from method
    prefix_only: bool = False  # ablation: zero weight after the first rejection (documented collapse)
    vh_weight: Optional[float] = None  # beta for the verification-head BCE; null = from method (vat: 1.0)
    vh_detach: bool = False  # ablation: the VH reads a detached hidden state (its BCE trains the head, not the body)
    onpolicy_chain: bool = True  # end the simulated chain where the data token is not the target's argmax
    union_weight: float = 0.0  # lambda: the union term's gradient on the draft logits as a fraction of imitation's
    union_norm: str = "grad_ratio"  # grad_ratio (lambda = gradient ratio, same on every target shape) | none (raw)
    union_top_m: int = 8  # candidates per draft step in the expected expert use
    union_scale_max: Optional[float] = None  # guard on the grad_ratio scale s; null = 1e4 (vat.union_scale.UNION_SCALE_MAX)
    union_scale_warmup: int = 20  # optimizer steps s is measured over once the affinity table is informative
    union_max_anchors: Optional[int] = 1024  # anchors sampled per step for the union term (memory N·K·L'·E); null = all
    affinity: Optional[str] = None  # precomputed affinity table (`vat prep affinity`); null = online EMA
    affinity_ema: float = 0.99
    affinity_storage: str = "float32"  # online table: float32 (dense EMA counts) | uint16 (compact rows, fp16 table)
    affinity_layer_stride: int = 1  # online table tracks MoE layers 0, s, 2s, ...: the union runs over those
    acceptance: str = "greedy"  # greedy | expected | sampled (simulated verification rule)
    imitation_chunk_mb: Optional[float] = 256.0  # fp32 MiB per chunk of the imitation loss (vat.imitation); null = autograd
    imitation_norm: Optional[str] = None  # anchors (VAT paper: sum over slots, mean over anchors) | weight_sum (DFlash:
    # weighted mean over slots); null = from method


@dataclass
class BudgetConfig:
    B: Any = None  # expert budget per layer: int, list (per MoE layer) or {layer: B}; null = no budget
    policy: str = DEFAULT_BUDGET_POLICY  # substitute | truncate (MoE-Spec) | truncate_cover
    window: Optional[int] = None  # window length; null = ttt_steps + 1 (the verification block)
    align: str = "response"  # response: windows restart at each response segment, random phase per row and step |
    # offset: one random offset per step over absolute positions (the old tiling; always with scope batch)
    scope: str = "sequence"  # sequence | batch
    train_mix: float = 0.0  # fraction of steps run unbudgeted


@dataclass
class LoraTrainConfig:
    """``train.lora``: LoRA adapters (peft) on the draft's decoder layer; exports are merged (vat/train/lora.py)."""

    r: int = 16  # adapter rank
    alpha: float = 32.0  # peft lora_alpha: the update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapter input
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # the decoder layer's Linears
    train_fc: bool = False  # also train fc (the aux-feature projection) in full; the verification head always is


@dataclass
class TrainConfig:
    max_steps: Optional[int] = None  # optimizer steps; null = epochs * steps per epoch
    epochs: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.015
    scheduler: str = "cosine"  # cosine | constant
    grad_clip: float = 0.5  # the draft body's gradient-norm clip (EAGLE-3's 0.5)
    vh_grad_clip: float = 1.0  # the verification head's own clip (its own parameter group)
    grad_accum: int = 1
    mixed_precision: str = "auto"  # auto (bf16 on GPU, no on CPU) | no | bf16
    log_every: int = 1
    save_every: int = 500
    keep_last: int = 3
    max_nonfinite: int = 10  # consecutive non-finite losses before the run stops
    stop_after: Optional[int] = None  # stop (as if killed) after this step, without writing final/ (resume tests)
    init_from: Optional[str] = None  # start from this EAGLE-3 draft (vat / SGLang / speculators dir): its architecture
    # and draft vocab replace drafter.* and data.vocab; the recipe's losses, ttt_steps and verification head apply
    lora: Optional[LoraTrainConfig] = None  # LoRA on the imported draft (needs init_from); null = full fine-tuning
    fsdp: bool = False  # shard the draft with FSDP2 (accelerate's plugin, GPUs only) instead of DDP: for large drafts


@dataclass
class WindowPoolLoraConfig:
    """``window_pool.lora``: LoRA adapters (peft) on the target's attention / experts, merged into the written target."""

    r: int = 8  # adapter rank
    alpha: float = 16.0  # peft lora_alpha: the update is scaled by alpha / r
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # Linears
    target_parameters: list[str] = field(default_factory=list)  # fused expert weights, e.g. [experts.gate_up_proj]


@dataclass
class WindowPoolConfig:
    """``kind: window_pool``: continued pretraining of the target's routers so that the tokens of one window share a
    pool of experts (docs/window_pool.md, vat/window_pool). W and d_w are drawn per step, uniformly from [lo, hi]."""

    # W range: window length in positions; null = one pool per packed row (the document-pool base: the row stands
    # in for a document, one pool for all its tokens, no offset)
    windows: Optional[list[int]] = field(default_factory=lambda: [4, 16])
    pools: list[int] = field(default_factory=lambda: [4, 8])  # d_w range: experts shared by a window (>= top_k)
    layers: Optional[list[int]] = None  # decoder layers constrained; null = every MoE layer
    unconstrained_frac: float = 0.25  # fraction of steps run with natural routing (keeps unconstrained quality)
    aux_loss_coef: Optional[float] = None  # load-balancing weight; null = the target config's router_aux_loss_coef
    pool_weight: float = 0.0  # weight of the pool-mass term: router mass outside the window's pool (0 = off)
    loss_on: str = "all"  # all (every real next token, pretraining-style) | mask (the data's loss_mask only)
    train_routers: bool = True  # the router gates train (with lora: also the adapters)
    lora: Optional[WindowPoolLoraConfig] = None  # null = routers only


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline | online
    project: str = "vat"
    name: Optional[str] = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True


@dataclass
class VatConfig:
    kind: str = "draft"  # draft (train a speculative draft) | window_pool (continued pretraining of the target's routers)
    method: str = "eagle3"  # eagle3 | vat | dflash | dflash_vat : presets for the loss switches
    output_dir: str = "runs/default"
    seed: int = 0
    resume: Optional[str] = None  # null | auto | path to checkpoints/step_N
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    window_pool: WindowPoolConfig = field(default_factory=WindowPoolConfig)  # used by kind: window_pool only


METHOD_PRESETS: dict[str, dict[str, Any]] = {
    # the canonical EAGLE-3 recipe: fixed 0.8^k weights, soft CE only
    "eagle3": {"adaptive_weights": False, "vh_weight": 0.0, "soft_weight": 1.0, "hard_weight": 0.0,
               "imitation_norm": "anchors", "verification_head": False},
    # VAT: verification-adaptive weights + verification head (beta = 1) + hard CE beside the soft one
    "vat": {"adaptive_weights": True, "vh_weight": 1.0, "soft_weight": 1.0, "hard_weight": 1.0,
            "imitation_norm": "anchors", "verification_head": True},
    # the DFlash recipe: hard CE on the data token, exp(-(k-1)/gamma) weights, normalised by the weight sum
    "dflash": {"adaptive_weights": False, "vh_weight": 0.0, "soft_weight": 0.0, "hard_weight": 1.0,
               "imitation_norm": "weight_sum", "verification_head": False},
    # DFlash + VAT: the VAT objective (soft + hard, adaptive weights re-anchored on the DFlash schedule, VH per slot)
    "dflash_vat": {"adaptive_weights": True, "vh_weight": 1.0, "soft_weight": 1.0, "hard_weight": 1.0,
                   "imitation_norm": "anchors", "verification_head": True},
}


def _expand_optional(node: Any) -> Any:
    """An optional section left at ``null`` (e.g. ``train.lora``) as its schema, so its keys can be checked."""
    if isinstance(node, DictConfig) and node._is_none() and dataclasses.is_dataclass(node._metadata.ref_type):
        return OmegaConf.structured(node._metadata.ref_type)
    return node


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    node = _expand_optional(node)
    if isinstance(node, DictConfig):
        for k in node.keys():
            full = f"{prefix}{k}"
            keys.append(full)
            keys.extend(_all_keys(node._get_node(k), full + "."))
    return keys


def closest_hint(key: str, valid: list[str]) -> str:
    """`` (did you mean `x`?)`` naming the valid key (or value) closest to ``key``, else ""."""
    last = key.split(".")[-1]
    cands = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not cands:
        cands = [k for k in valid if k.split(".")[-1] in difflib.get_close_matches(last, [v.split(".")[-1] for v in valid], n=1, cutoff=0.6)]
    return f" (did you mean `{cands[0]}`?)" if cands else ""


def _check_keys(user: Any, schema: DictConfig, prefix: str = "") -> None:
    """Raise a one-line VatError for the first key of ``user`` that the schema does not have."""
    if not isinstance(user, (DictConfig, dict)):
        return
    valid = _all_keys(schema)
    for k in user.keys():
        full = f"{prefix}{k}"
        if full not in valid:
            raise VatError(f"unknown config key `{full}`{closest_hint(full, valid)}")
        sub = schema
        for part in full.split("."):
            sub = _expand_optional(sub)._get_node(part)
        if isinstance(sub, DictConfig) and not full.startswith("budget.B"):
            child = user[k]
            if isinstance(child, (DictConfig, dict)):
                _check_keys(child, schema, full + ".")


def _expected_type(key: str) -> str:
    """The annotated type of a dotted key in :class:`VatConfig`, as written in the schema."""
    cls: Any = VatConfig
    hint: Any = None
    for part in key.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return "?"
        hint = hints[part]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is typing.Union and len(args) == 1:
            hint = args[0]  # Optional[X] -> X
        cls = hint
    name = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None
    return name or str(hint).replace("typing.", "")


def _type_error(err: ValidationError) -> VatError:
    key = getattr(err, "full_key", None) or "?"
    value = str(err).splitlines()[0]
    found = re.search(r"Value '([^']*)'", value)
    shown = f"`{found.group(1)}`" if found else value
    return VatError(f"bad value {shown} for config key `{key}`: expected {_expected_type(key)}")


def load_yaml_mapping(path: str, what: str) -> Any:
    """A YAML file of config keys, or one clear line: missing file, YAML syntax error, or not a mapping."""
    if not os.path.exists(path):
        raise VatError(f"{what} not found: {path}")
    try:
        user = OmegaConf.load(path)
    except Exception as err:  # yaml syntax error
        raise VatError(f"cannot parse {what} {path}: {str(err).splitlines()[0]}") from None
    if isinstance(user, ListConfig):
        raise VatError(f"{what} {path} must be a mapping of config keys, not a list")
    return user


def load_config(recipe: Optional[str] = None, overrides: Optional[list[str]] = None) -> VatConfig:
    """Build the run configuration from a YAML recipe plus dotted overrides.

    Args:
        recipe: path to a YAML recipe, or None for the defaults.
        overrides: strings ``key.sub=value`` (YAML-typed values).

    Returns:
        A :class:`VatConfig` (an OmegaConf structured config with attribute access), with the method preset applied.

    Raises:
        VatError: a missing recipe, an unknown key (naming the closest valid one) or a value of the wrong type.
    """

    schema = OmegaConf.structured(VatConfig)
    layers = []
    if recipe is not None:
        user = load_yaml_mapping(resolve_recipe(recipe), "recipe")  # a packaged recipe when not a file here
        _check_keys(user, schema)
        layers.append(user)
    for item in overrides or []:
        if "=" not in item:
            raise VatError(f"override `{item}` is not of the form key.sub=value")
        key = item.split("=", 1)[0].lstrip("+")
        valid = _all_keys(schema)
        if key not in valid and not key.startswith("budget.B."):
            raise VatError(f"unknown config key `{key}`{closest_hint(key, valid)}")
        layers.append(OmegaConf.from_dotlist([item.lstrip("+")]))
    try:
        cfg = OmegaConf.merge(schema, *layers)
    except ValidationError as err:
        raise _type_error(err) from None
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise VatError(f"unknown config key: {str(err).splitlines()[0]}") from None
    _check_choices(cfg)
    if cfg.train.init_from and cfg.data.vocab:
        raise VatError(f"config keys `train.init_from` and `data.vocab` are both set: the imported draft "
                       f"{cfg.train.init_from} brings its own draft vocabulary; unset data.vocab")
    if cfg.train.lora is not None and not cfg.train.init_from:
        raise VatError("config key `train.lora` needs `train.init_from`: adapters on a freshly initialised draft "
                       "would adapt random weights; set train.init_from=DRAFT_DIR or train.lora=null")
    if cfg.loss.union_scale_warmup < 1:
        raise VatError(f"config key `loss.union_scale_warmup` must be >= 1 (optimizer steps the scale is measured "
                       f"over), got {cfg.loss.union_scale_warmup}")
    apply_method_preset(cfg)
    return cfg  # type: ignore[return-value]


# keys whose value is one of a fixed set; checked when the config loads, before any model is
CHOICES: dict[str, tuple[str, ...]] = {
    "kind": ("draft", "window_pool"),
    "window_pool.loss_on": ("all", "mask"),
    "target.experts_impl": ("eager", "grouped_mm", "batched_mm", "triton"),
    "loss.acceptance": ("greedy", "expected", "sampled"),
    "loss.union_norm": ("grad_ratio", "none"),
    "drafter.vh_input": ("normed", "prenorm"),
    "drafter.attention": TRAINING_ATTENTION,
    "budget.policy": TRAINING_BUDGET_POLICIES,
    "budget.scope": ("sequence", "batch"),
    "budget.align": ("response", "offset"),
    "train.scheduler": ("cosine", "constant"),
    "train.mixed_precision": ("auto", "no", "bf16", "fp16"),
    "logging.wandb.mode": ("disabled", "offline", "online"),
}


def _check_choices(cfg: Any) -> None:
    """One line naming the key, the value and the valid ones (closest first) for an out-of-set value."""
    for key, valid in CHOICES.items():
        section, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, section)
        value = node[leaf]
        if value == "False" and "no" in valid:  # YAML reads an unquoted `no` as false
            node[leaf] = value = "no"
        if value not in valid:
            raise VatError(f"bad value `{value}` for config key `{key}`{closest_hint(str(value), list(valid))}; "
                           f"one of {', '.join(valid)}")


def apply_method_preset(cfg: Any) -> None:
    """Fill every ``null`` loss/drafter switch from the ``method`` preset (explicit values win)."""
    if cfg.method not in METHOD_PRESETS:
        raise VatError(f"unknown method `{cfg.method}`{closest_hint(cfg.method, list(METHOD_PRESETS))}; one of {sorted(METHOD_PRESETS)}")
    preset = METHOD_PRESETS[cfg.method]
    for key in ("adaptive_weights", "vh_weight", "soft_weight", "hard_weight", "imitation_norm"):
        if cfg.loss[key] is None:
            cfg.loss[key] = preset[key]
    if cfg.drafter.verification_head is None:
        cfg.drafter.verification_head = bool(preset["verification_head"] or (cfg.loss.vh_weight or 0) > 0)
    if cfg.method.startswith("dflash") and cfg.drafter.kind == "eagle3":
        cfg.drafter.kind = "dflash"


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (written next to every checkpoint)."""
    return OmegaConf.to_yaml(cfg)
