"""The registry of eval policies: one line per policy (its module in this package, its class here).

:data:`EVAL_POLICIES` maps each name to its :class:`vat.eval.policies.EvalPolicy` class; the order is the order of
`vat eval --help` and of the one-line "one of ..." errors. The choices of ``EvalConfig.tree_policy`` are the names
whose ``setting`` is ``tree_policy``; a ``policy`` entry is the eval side of a rule of
:data:`vat.target.budget.POLICIES` (which lists the budget policy choices).
"""

from __future__ import annotations

from typing import Any

from vat.errors import VatError
from vat.eval.policies import EvalPolicy, acceptmoe, budget_rank, confidence, ecospec, evict
from vat.target.budget import POLICIES, RANKS

EVAL_POLICIES: dict[str, type[EvalPolicy]] = {
    "confidence": confidence.Confidence,
    "evict": evict.EvictPolicy,
    "ecospec": ecospec.EcoSpecPolicy,
    "acceptmoe": acceptmoe.AcceptMoEPolicy,
    "routing": budget_rank.RoutingRankPolicy,
}
SETTINGS = ("tree_policy", "policy", "budget_rank")  # the EvalConfig fields that pick registered policies

DEFAULT_TREE_POLICY = "confidence"


def choices(setting: str) -> tuple[str, ...]:
    """The registered names picked by ``setting`` (``tree_policy`` or ``policy``), in registry order."""
    return tuple(name for name, cls in EVAL_POLICIES.items() if cls.setting == setting)


def policy_class(setting: str, name: str) -> type[EvalPolicy] | None:
    """The class ``setting = name`` picks (None: not registered under that setting, e.g. a plain budget rule)."""
    cls = EVAL_POLICIES.get(name)
    return cls if cls is not None and cls.setting == setting else None


def picked(cfg: Any, tree: Any) -> list[EvalPolicy]:
    """The policies an :class:`vat.eval.config.EvalConfig` picks, built (each checks its settings); a setting only an
    unpicked policy reads stops in one line."""
    chosen = [policy_class(s, getattr(cfg, s)) for s in SETTINGS]
    for name, cls in EVAL_POLICIES.items():
        if cls in chosen:
            continue
        for field, what in cls.settings.items():
            if what is not None and getattr(cfg, field) is not None:
                raise VatError(f"--{field.replace('_', '-')} is {what}: add --{cls.setting.replace('_', '-')} {name}")
    return [cls(cfg, tree) for cls in chosen if cls is not None]


def default_budget(policy: str) -> str | None:
    """``--budget`` when unset under budget policy ``policy`` (None = natural routing)."""
    cls = policy_class("policy", policy)
    return None if cls is None else cls.default_budget


def self_sized(policy: str) -> bool:
    """Whether budget policy ``policy`` takes ``--budget auto``."""
    cls = policy_class("policy", policy)
    return cls is not None and cls.self_sized


def settings_record(cfg: Any, policies: list[EvalPolicy]) -> dict:
    """eval.json ``settings`` entries of every registered policy's settings (None unless that policy ran)."""
    ran = {type(p) for p in policies}
    return {field: getattr(cfg, field) if cls in ran else None
            for cls in EVAL_POLICIES.values() for field in cls.settings}


def run_record(policies: list[EvalPolicy]) -> dict:
    """Top-level eval.json keys of every registered policy (None unless that policy ran)."""
    out: dict = {key: None for cls in EVAL_POLICIES.values() for key in cls.run_keys}
    for p in policies:
        out.update(p.run_record())
    return out


def policy_help(setting: str) -> tuple[tuple[str, ...], str]:
    """`vat eval --help` of ``--tree-policy`` / ``--policy``: the choices (the registry's; for ``policy`` the rules of
    :data:`vat.target.budget.POLICIES`) and ``name = summary`` of each registered one."""
    names = POLICIES if setting == "policy" else RANKS if setting == "budget_rank" else choices(setting)
    return names, "; ".join(f"{name} = {EVAL_POLICIES[name].summary}" for name in choices(setting))
