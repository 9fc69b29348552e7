"""The `vat bench` config: seeds x methods -> trained drafts -> real eval -> intervals (docs/bench.md).

Its own schema and loader beside the training config's (:mod:`vat.config`), whose key checks it reuses
(``_all_keys``, ``_check_keys``, ``closest_hint``), so an unknown bench key stops at once with the closest valid one, as
for a training recipe. It lives in the bench package because checking a bench's eval settings needs the eval layer
(budget policies, tree policies, accelerators, free drafts), which the training config must not import.
"""

from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from vat.config import _all_keys, _check_keys, closest_hint, load_yaml_mapping
from vat.errors import VatError
from vat.eval.config import EVAL_DEFAULTS, check_eval_section
from vat.eval.free_drafts import DEFAULT_GRID, GRID_NAME, expand_baselines, parse_free_draft

BENCH_BASELINES = ("ngram", "none")  # the default baselines: prompt lookup (vLLM's rule) and autoregressive


def _names_free_draft(name: str) -> bool:
    try:
        return parse_free_draft(name) is not None
    except VatError:
        return False


# the bench's eval section: a subset of vat.eval.config.EvalConfig's fields (tested), with the EvalConfig's defaults
# except where a bench differs on purpose (two benchmarks, 120 prompts, 64 new tokens, a list of budgets)
@dataclass
class BenchMethodEvalConfig:  # per-method eval overrides (null = the bench's eval.* value); part of the cell's key
    steps: Optional[int] = None  # chain length K
    tree: Optional[str] = None  # dynamic tree "top_k,depth,total_tokens" (vat eval --tree); "chain" = no tree
    tree_policy: Optional[str] = None  # which drafted tokens are verified: a selection policy of vat.eval.policies
    verify_cost: Optional[str] = None  # EVICT's profile (vat profile --verify-widths); null = profiled on the fly
    evict_calibration: Optional[int] = None  # EVICT's calibration prompts (dev split); 0 = raw estimates
    budgets: Optional[list[Any]] = None  # expert budgets B of this method's evaluation (ints, null, auto)
    policy: Optional[str] = None  # budget policy (vat eval --policy)
    budget_rank: Optional[str] = None  # scores ranking the budget set: weights | routing (vat eval --budget-rank)
    vh_threshold: Optional[float] = None  # stop drafting on the verification head's signal
    draft_confidence: Optional[float] = None  # stop a chain after a token the draft gives less than this probability
    cost_model: Optional[str] = None  # roofline bytes model (h100 | h200 | a100 | l40s[@eta=η,latency_us=µs])
    commitment: Optional[str] = None  # AcceptMoE's p̂: an eval.json of the draft or a JSON list ({bench_dir}, {seed})
    acceptmoe_residency: Optional[int] = None  # AcceptMoE under offload: prune against a live cache of C experts
    ecospec_lambda: Optional[float] = None  # EcoSpec's λ: nats of log-probability one predicted new expert costs
    affinity: Optional[str] = None  # EcoSpec's expert predictor: a table or `vat prep expert-probe` file ({seed})


@dataclass
class BenchMethodConfig:
    recipe: str = ""  # training recipe: a path, or a packaged name such as tiny/eagle3.yaml
    overrides: list[str] = field(default_factory=list)  # dotted overrides for this method only (after train_overrides)
    draft: str = ""  # instead of a recipe: an existing draft dir, evaluated as it is ({bench_dir}, {seed} filled)
    target: str = ""  # this method's own target (a path or tiny name): trained and evaluated on it, side by side
    eval: BenchMethodEvalConfig = field(default_factory=BenchMethodEvalConfig)  # this method's eval overrides


@dataclass
class BenchEvalConfig:
    benchmarks: list[str] = field(default_factory=lambda: ["spec_bench", "humaneval"])
    limit: Optional[int] = 120  # prompts per benchmark (balanced over Spec-Bench's categories); null = all
    max_new_tokens: int = 64  # per turn
    steps: int = EVAL_DEFAULTS.steps  # chain length K
    budgets: list[Optional[int]] = field(default_factory=lambda: [None])  # expert budgets B; null = natural routing
    temperature: float = EVAL_DEFAULTS.temperature  # 0 = greedy (lossless)
    tree: Optional[str] = EVAL_DEFAULTS.tree  # dynamic tree "top_k,depth,total_tokens"; null = chain of `steps`
    tree_policy: str = EVAL_DEFAULTS.tree_policy  # which drafted tokens are verified (vat.eval.config)
    verify_cost: Optional[str] = EVAL_DEFAULTS.verify_cost  # EVICT's verification-cost profile; null = on the fly
    evict_calibration: Optional[int] = EVAL_DEFAULTS.evict_calibration  # EVICT's calibration prompts; 0 = raw
    policy: str = EVAL_DEFAULTS.policy  # budget policy
    budget_rank: str = EVAL_DEFAULTS.budget_rank  # scores ranking the budget set: weights | routing (an extension)
    vh_threshold: Optional[float] = EVAL_DEFAULTS.vh_threshold  # stop drafting on the verification head's signal
    draft_confidence: Optional[float] = EVAL_DEFAULTS.draft_confidence  # a chain's confidence stop (vat eval)
    cost_model: Optional[str] = EVAL_DEFAULTS.cost_model  # roofline bytes model (h200, h200@eta=0.8,latency_us=10)
    offload: Optional[str] = EVAL_DEFAULTS.offload  # expert offloading: resident experts per layer, "8,16" (cost_model)
    offload_policy: str = EVAL_DEFAULTS.offload_policy  # lru | lfu: which resident expert a load evicts
    offload_link: str = EVAL_DEFAULTS.offload_link  # pcie5 | c2c: the host-to-device link
    commitment: Optional[str] = EVAL_DEFAULTS.commitment  # AcceptMoE's p̂ ({bench_dir}, {seed} filled); null = prior
    acceptmoe_residency: Optional[int] = EVAL_DEFAULTS.acceptmoe_residency  # AcceptMoE's residency pruning at C
    ecospec_lambda: float = EVAL_DEFAULTS.ecospec_lambda  # EcoSpec's λ
    affinity: Optional[str] = EVAL_DEFAULTS.affinity  # EcoSpec's expert predictor ({bench_dir}, {seed}); null = draft's


@dataclass
class BenchCurveConfig:
    steps: list[int] = field(default_factory=list)  # checkpoint steps evaluated for τ vs training tokens; [] = off
    limit: Optional[int] = 24  # prompts per benchmark for each curve point (a subset of the main eval's)


@dataclass
class BenchBootstrapConfig:
    samples: int = 2000  # bootstrap replicates
    seed: int = 0
    confidence: float = 0.95


@dataclass
class BenchConfig:
    name: str = "bench"
    output_dir: str = "runs/bench"
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # seed i of every method shares data order
    methods: dict[str, BenchMethodConfig] = field(default_factory=dict)  # label -> recipe + overrides
    train_overrides: list[str] = field(default_factory=list)  # applied to every method (target, data, steps ...)
    baselines: list[str] = field(default_factory=lambda: list(BENCH_BASELINES))  # training-free; evaluated once
    reference: str = "eagle3"  # the method every ratio is taken against
    compare: list[str] = field(default_factory=list)  # more methods every method is also paired with, seed by seed
    eval: BenchEvalConfig = field(default_factory=BenchEvalConfig)
    curve: BenchCurveConfig = field(default_factory=BenchCurveConfig)
    bootstrap: BenchBootstrapConfig = field(default_factory=BenchBootstrapConfig)


_BENCH_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_+-]*$")  # method labels name directories and config keys


def _bench_schema(labels: list[str]) -> DictConfig:
    """The bench schema with a method entry per label, so nested method keys are checked like any other."""
    schema = OmegaConf.structured(BenchConfig)
    for label in labels:
        schema.methods[label] = OmegaConf.structured(BenchMethodConfig)
    return schema


def _bench_expected_type(key: str) -> str:
    """The annotated type of a dotted bench key (a method label steps into :class:`BenchMethodConfig`)."""
    cls: Any = BenchConfig
    hint: Any = None
    parts = key.split(".")
    for i, part in enumerate(parts):
        if cls is BenchMethodConfig and i >= 1 and parts[i - 1] == "methods":
            continue  # the label itself
        hints = typing.get_type_hints(cls) if hasattr(cls, "__dataclass_fields__") else {}
        if part not in hints:
            return "?"
        hint = hints[part]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is typing.Union and len(args) == 1:
            hint = args[0]
        cls = BenchMethodConfig if part == "methods" else hint
    name = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None
    return name or str(hint).replace("typing.", "")


def load_bench_config(path: Optional[str], overrides: Optional[list[str]] = None) -> BenchConfig:
    """Build a bench configuration from a YAML file plus dotted overrides.

    Args:
        path: the bench YAML (e.g. ``recipes/bench/tiny.yaml``), or None for the defaults.
        overrides: ``key.sub=value`` strings; ``methods.<label>.recipe=...`` adds or changes a method.

    Returns:
        A :class:`BenchConfig` (OmegaConf structured, attribute access), validated.

    Raises:
        VatError: a missing file, an unknown key (naming the closest valid one), a value of the wrong type, or
            an inconsistent bench (no methods, a reference that is not a method, an unknown baseline ...).
    """

    user: Any = OmegaConf.create({})
    if path is not None:
        user = load_yaml_mapping(path, "bench config")
    items = list(overrides or [])
    for item in items:
        if "=" not in item:
            raise VatError(f"override `{item}` is not of the form key.sub=value")
    labels = list((user.get("methods") or {}).keys())
    for label in labels:  # before the key check: a `.` would split `methods.<label>.recipe` into other keys
        _check_label(label)
    labels += [i.split("=", 1)[0].lstrip("+").split(".")[1] for i in items
               if i.lstrip("+").startswith("methods.") and i.count(".", 0, i.find("=")) >= 2]
    schema = _bench_schema(list(dict.fromkeys(labels)))
    _check_keys(user, schema)
    valid = _all_keys(schema)
    layers = [user]
    for item in items:
        key = item.split("=", 1)[0].lstrip("+")
        if key not in valid:
            raise VatError(f"unknown bench config key `{key}`{closest_hint(key, valid)}")
        layers.append(OmegaConf.from_dotlist([item.lstrip("+")]))
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(BenchConfig), *layers)
    except ValidationError as err:
        key = getattr(err, "full_key", None) or "?"
        first = str(err).splitlines()[0]
        found = re.search(r"Value '([^']*)'", first)
        shown, detail = (f" `{found.group(1)}`", "") if found else ("", f" ({first})")
        raise VatError(f"bad value{shown} for bench config key `{key}`: expected {_bench_expected_type(key)}{detail}") from None
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise VatError(f"unknown bench config key: {str(err).splitlines()[0]}") from None
    _check_bench(cfg)
    return cfg  # type: ignore[return-value]


def _check_label(label: Any) -> None:
    """A method label names a directory and the dotted config key ``methods.<label>``: no `.` in it."""
    if not _BENCH_LABEL.match(str(label)):
        raise VatError(f"method label `{label}` must be letters, digits and _ + - (it names a directory and the config "
                       "key methods.<label>: write 0.1 as 0p1)")


def _check_bench(cfg: Any) -> None:
    """Reject a bench that cannot produce its table, with one line naming the key."""
    if not cfg.methods:
        raise VatError("bench config has no `methods` (label: {recipe: ..., overrides: [...]})")
    for label, method in cfg.methods.items():
        _check_label(label)
        if not method.recipe and not method.draft:
            raise VatError(f"bench config key `methods.{label}.recipe` is empty: name the training recipe (or "
                           f"`methods.{label}.draft`, an existing draft to evaluate)")
        if method.recipe and method.draft:
            raise VatError(f"method {label}: set `recipe` (train a draft) or `draft` (evaluate an existing one), not both")
        if method.draft and method.overrides:
            raise VatError(f"method {label}: `overrides` are training overrides; a `draft` method trains nothing")
    if cfg.reference not in cfg.methods:
        raise VatError(f"bench config key `reference`: `{cfg.reference}` is not a method"
                       f"{closest_hint(cfg.reference, list(cfg.methods))}; one of {', '.join(cfg.methods)}")
    for other in cfg.compare:
        if other not in cfg.methods:
            raise VatError(f"bench config key `compare`: `{other}` is not a method"
                           f"{closest_hint(str(other), list(cfg.methods))}; one of {', '.join(cfg.methods)}")
    cfg.baselines = expand_baselines(cfg.baselines)
    for base in cfg.baselines:
        if base != "none" and not _names_free_draft(base):
            known = ["none", GRID_NAME, "ngram", "suffix", *DEFAULT_GRID]
            raise VatError(f"bad baseline `{base}`{closest_hint(str(base), known)}; `none`, `{GRID_NAME}` (the grid "
                           f"{', '.join(DEFAULT_GRID)}) or a free draft name (ngram-RULE-MIN-MAX, suffix[-dDEPTH])")
    for label in cfg.methods:
        if label in ("none", GRID_NAME) or _names_free_draft(label):
            raise VatError(f"method label `{label}` is the name of a training-free baseline; rename the method")
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        raise VatError(f"bench config key `seeds` needs at least one seed and no repeats, got {list(cfg.seeds)}")
    checks = [
        ("eval.benchmarks", len(cfg.eval.benchmarks) >= 1, "at least one benchmark"),
        ("eval.limit", cfg.eval.limit is None or cfg.eval.limit >= 1, ">= 1 or null"),
        ("eval.max_new_tokens", cfg.eval.max_new_tokens >= 1, ">= 1"),
        ("eval.steps", cfg.eval.steps >= 1, ">= 1"),
        ("eval.budgets", len(cfg.eval.budgets) >= 1 and all(b is None or b >= 1 for b in cfg.eval.budgets),
         "a non-empty list of budgets >= 1 or null"),
        ("eval.temperature", cfg.eval.temperature >= 0, ">= 0"),
        ("curve.steps", all(s >= 1 for s in cfg.curve.steps), "steps >= 1"),
        ("curve.limit", cfg.curve.limit is None or cfg.curve.limit >= 1, ">= 1 or null"),
        ("bootstrap.samples", cfg.bootstrap.samples >= 1, ">= 1"),
        ("bootstrap.confidence", 0 < cfg.bootstrap.confidence < 1, "between 0 and 1"),
    ]
    for key, ok, need in checks:
        if not ok:
            raise VatError(f"bad value `{OmegaConf.select(cfg, key)}` for bench config key `{key}`: {need}")
    _check_bench_eval(cfg)


def _check_bench_eval(cfg: Any) -> None:
    """The eval variants (bench ``eval.*`` and each method's ``eval`` overrides) name things `vat eval` knows: the
    eval config's own choices (:func:`vat.eval.config.check_eval_section`)."""
    sections = [("eval", cfg.eval)] + [(f"methods.{label}.eval", m.eval) for label, m in cfg.methods.items()]
    for where, ev in sections:
        check_eval_section(where, policy=ev.policy, tree_policy=ev.tree_policy, tree=ev.tree,
                           cost_model=ev.cost_model, budgets=list(ev.budgets) if ev.budgets is not None else [None],
                           budget_rank=ev.budget_rank)
    ev = cfg.eval
    check_eval_section("eval", offload=ev.offload, offload_policy=ev.offload_policy, offload_link=ev.offload_link,
                       cost_model=ev.cost_model)


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``key old -> new`` for each leaf that differs, ``key added`` / ``key removed`` for a whole missing section."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [f"{prefix} {old} -> {new}"]
    found: list[str] = []
    for key in [*old, *(k for k in new if k not in old)]:
        name = f"{prefix}.{key}" if prefix else str(key)
        if key not in new or key not in old:
            found.append(f"{name} {'removed' if key not in new else 'added'}")
        else:
            found += _differences(old[key], new[key], name)
    return found


def config_changes(path: str, bench: Any, shown: int = 6) -> str:
    """How ``bench`` differs from the bench config an earlier run (or another shard) wrote at ``path``, as
    ``key old -> new`` items (at most ``shown``, then a count); '' when it does not, or when ``path`` is absent or
    names another bench (benches sharing a cells folder report apart)."""
    if not os.path.isfile(path):
        return ""
    old = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(old, dict) or old.get("name") != bench.name:
        return ""
    changed = _differences(old, OmegaConf.to_container(bench, resolve=False))
    more = f" and {len(changed) - shown} more" if len(changed) > shown else ""
    return ", ".join(changed[:shown]) + more
