"""Typed configuration: dataclass schemas, YAML recipes and dotted CLI overrides (OmegaConf structured, strict).

A recipe is a YAML file whose keys are a subset of :class:`VatConfig`; overrides are ``key.sub=value`` strings
applied at the entry point only. An unknown key stops at once with one line naming it and the closest valid key;
a value of the wrong type names the key and the expected type.

``method`` is a preset for the loss switches (``eagle3`` = the canonical EAGLE-3 baseline, ``vat`` = verification-aware
training); every ``loss.*`` switch left at ``null`` takes the preset's value, so each ablation is one override.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from vat.errors import VatError


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
    block_size: int = 16  # DFlash block
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    verification_head: Optional[bool] = None  # null = from method (vat: on)
    rope_theta: Optional[float] = None


@dataclass
class LossConfig:
    decay: float = 0.8  # EAGLE-3 base weight w_k = decay^k
    dflash_gamma: Optional[float] = None  # DFlash base weight exp(-(k-1)/gamma); null = 7 (block 16) scaled
    soft_weight: float = 1.0  # soft CE against the target distribution on the draft vocab
    hard_weight: Optional[float] = None  # hard CE on the target's argmax; null = from method
    adaptive_weights: Optional[bool] = None  # verification-adaptive weighting; null = from method
    prefix_only: bool = False  # ablation: zero weight after the first rejection (documented collapse)
    vh_weight: Optional[float] = None  # beta for the verification-head BCE; null = from method (vat: 1.0)
    vh_detach: bool = False  # the VH reads a detached hidden state: its BCE trains the head, not the draft body
    union_weight: float = 0.0  # lambda for the expert-union penalty (0 = off)
    union_top_m: int = 8  # candidates per draft step in the expected expert use
    union_max_anchors: Optional[int] = 1024  # anchors sampled per step for the union term (memory N·K·L'·E); null = all
    affinity: Optional[str] = None  # precomputed affinity table (`vat prep affinity`); null = online EMA
    affinity_ema: float = 0.99
    acceptance: str = "greedy"  # greedy | expected | sampled (simulated verification rule)


@dataclass
class BudgetConfig:
    B: Any = None  # expert budget per layer: int, list (per MoE layer) or {layer: B}; null = no budget
    policy: str = "substitute"  # substitute | truncate
    window: Optional[int] = None  # window length; null = ttt_steps + 1 (the verification block)
    scope: str = "sequence"  # sequence | batch
    train_mix: float = 0.0  # fraction of steps run unbudgeted


@dataclass
class TrainConfig:
    max_steps: Optional[int] = None  # optimizer steps; null = epochs * steps per epoch
    epochs: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.015
    scheduler: str = "cosine"  # cosine | constant
    grad_clip: float = 0.5
    grad_accum: int = 1
    mixed_precision: str = "auto"  # auto (bf16 on GPU, no on CPU) | no | bf16
    log_every: int = 1
    save_every: int = 500
    keep_last: int = 3
    max_nonfinite: int = 10  # consecutive non-finite losses before the run stops
    stop_after: Optional[int] = None  # stop (as if killed) after this step, without writing final/ (resume tests)


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


METHOD_PRESETS: dict[str, dict[str, Any]] = {
    # the canonical EAGLE-3 recipe: fixed 0.8^k weights, soft CE only
    "eagle3": {"adaptive_weights": False, "vh_weight": 0.0, "hard_weight": 0.0, "verification_head": False},
    # VAT: verification-adaptive weights + verification head (beta = 1) + hard CE beside the soft one
    "vat": {"adaptive_weights": True, "vh_weight": 1.0, "hard_weight": 1.0, "verification_head": True},
    "dflash": {"adaptive_weights": False, "vh_weight": 0.0, "hard_weight": 1.0, "verification_head": False},
    "dflash_vat": {"adaptive_weights": True, "vh_weight": 1.0, "hard_weight": 1.0, "verification_head": True},
}


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            full = f"{prefix}{k}"
            keys.append(full)
            keys.extend(_all_keys(node._get_node(k), full + "."))
    return keys


def _closest(key: str, valid: list[str]) -> str:
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
            raise VatError(f"unknown config key `{full}`{_closest(full, valid)}")
        sub = schema
        for part in full.split("."):
            sub = sub._get_node(part)
        if isinstance(sub, DictConfig) and not full.startswith("budget.B"):
            child = user[k]
            if isinstance(child, (DictConfig, dict)):
                _check_keys(child, schema, full + ".")


def _expected_type(key: str) -> str:
    """The annotated type of a dotted key in :class:`VatConfig`, as written in the schema."""
    import typing

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
    import os

    schema = OmegaConf.structured(VatConfig)
    layers = []
    if recipe is not None:
        if not os.path.exists(recipe):
            raise VatError(f"recipe not found: {recipe}")
        try:
            user = OmegaConf.load(recipe)
        except Exception as err:  # yaml syntax error
            raise VatError(f"cannot parse recipe {recipe}: {str(err).splitlines()[0]}") from None
        if isinstance(user, ListConfig):
            raise VatError(f"recipe {recipe} must be a mapping of config keys, not a list")
        _check_keys(user, schema)
        layers.append(user)
    for item in overrides or []:
        if "=" not in item:
            raise VatError(f"override `{item}` is not of the form key.sub=value")
        key = item.split("=", 1)[0].lstrip("+")
        valid = _all_keys(schema)
        if key not in valid and not key.startswith("budget.B."):
            raise VatError(f"unknown config key `{key}`{_closest(key, valid)}")
        layers.append(OmegaConf.from_dotlist([item.lstrip("+")]))
    try:
        cfg = OmegaConf.merge(schema, *layers)
    except ValidationError as err:
        raise _type_error(err) from None
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise VatError(f"unknown config key: {str(err).splitlines()[0]}") from None
    _check_choices(cfg)
    apply_method_preset(cfg)
    return cfg  # type: ignore[return-value]


# keys whose value is one of a fixed set; checked when the config loads, before any model is
CHOICES: dict[str, tuple[str, ...]] = {
    "target.experts_impl": ("eager", "grouped_mm", "batched_mm", "triton"),
    "drafter.kind": ("eagle3", "dflash"),
    "loss.acceptance": ("greedy", "expected", "sampled"),
    "budget.policy": ("substitute", "truncate"),
    "budget.scope": ("sequence", "batch"),
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
            raise VatError(f"bad value `{value}` for config key `{key}`{_closest(str(value), list(valid))}; "
                           f"one of {', '.join(valid)}")


def apply_method_preset(cfg: Any) -> None:
    """Fill every ``null`` loss/drafter switch from the ``method`` preset (explicit values win)."""
    if cfg.method not in METHOD_PRESETS:
        raise VatError(f"unknown method `{cfg.method}`{_closest(cfg.method, list(METHOD_PRESETS))}; one of {sorted(METHOD_PRESETS)}")
    preset = METHOD_PRESETS[cfg.method]
    for key in ("adaptive_weights", "vh_weight", "hard_weight"):
        if cfg.loss[key] is None:
            cfg.loss[key] = preset[key]
    if cfg.drafter.verification_head is None:
        cfg.drafter.verification_head = bool(preset["verification_head"] or (cfg.loss.vh_weight or 0) > 0)
    if cfg.method.startswith("dflash") and cfg.drafter.kind == "eagle3":
        cfg.drafter.kind = "dflash"


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (written next to every checkpoint)."""
    return OmegaConf.to_yaml(cfg)
