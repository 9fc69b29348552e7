"""Eval policies: what `vat eval` may do to a round besides drafting and verifying it.

A policy is one module in this package and one line in :data:`vat.eval.policies.registry.EVAL_POLICIES`; nothing
else in the engine or in `vat eval` names it. Two classes describe it:

* :class:`RoundPolicy`: the hooks :class:`vat.eval.engine.SpeculativeEngine` calls in every round (its ``policies``
  keyword): cut a drafted chain / DFlash block (:meth:`RoundPolicy.cut_chain`) or tree
  (:meth:`RoundPolicy.cut_tree`), choose the tree's nodes (:meth:`RoundPolicy.selector`) and the nodes each draft step
  expands (:meth:`RoundPolicy.expander`), adjust the verification
  forward's expert budget (:meth:`RoundPolicy.budget_spec`). Each is a no-op here; a policy overrides the ones it needs.
* :class:`EvalPolicy`: the registry entry. It declares its name, the :class:`vat.eval.config.EvalConfig` field that
  picks it (``tree_policy``: selection policies; ``policy``: the eval side of a budget policy whose expert-set rule is
  in :mod:`vat.target.budget`), the settings only it reads, and how `vat eval` runs it: checked with the config
  (``__init__``), set up once the target and drafts are loaded (:meth:`EvalPolicy.setup`), told each benchmark's
  prompts (:meth:`EvalPolicy.start_benchmark`), asked for the :class:`RoundPolicy` of each pass (draft x budget,
  :meth:`EvalPolicy.for_pass`), and asked what it adds to eval.json (settings, per draft, top level).

This module imports no policy (the algorithms in :mod:`vat.eval.evict` / :mod:`vat.eval.ecospec` subclass
:class:`RoundPolicy`); the registry imports them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # annotations only: these modules import this one
    from vat.eval.chain import ChainDraft
    from vat.eval.tree import DraftTree
    from vat.target.budget import BudgetSpec


class RoundPolicy:
    """The hooks the engine calls in every round of one pass (each a no-op here)."""

    def cut_chain(self, draft: ChainDraft, context: int, mode: str) -> ChainDraft:
        """A trained draft's chain (``mode`` ``chain``) or DFlash block (``block``) before verification; a prefix of it
        keeps decoding lossless. ``context``: the target's cached positions before the block. N-gram chains are never
        cut."""
        return draft

    def cut_tree(self, tree: DraftTree, context: int, top_k: int) -> DraftTree:
        """A drafted tree before verification (a prefix-closed subset keeps decoding lossless)."""
        return tree

    def selector(self, root: int) -> Any:
        """The ``select`` of :func:`vat.eval.tree.build_tree` for a block whose root is ``root`` (None = by
        log-probability); at most one policy of a pass returns one."""
        return None

    def expander(self, root: int) -> Any:
        """The ``expand`` of :func:`vat.eval.tree.build_tree` for a block whose root is ``root``: which candidates each
        draft step expands (None = by log-probability); at most one policy of a pass returns one."""
        return None

    def budget_spec(self, spec: BudgetSpec) -> BudgetSpec:
        """The verification forwards' budget (``BudgetSpec(B, policy)``; only called under a budget)."""
        return spec

    def observe(self, accepted: list[int]) -> None:
        """After verification: the indices of the drafted nodes (of the chain, block or tree as verified, after every
        cut) on the committed path, root excluded."""

    #: the engine calls :meth:`executed` after every verification forward only when a policy of the pass sets this
    observes_experts: ClassVar[bool] = False

    def executed(self, expert_sets: list[list[int]], ids: Any) -> None:
        """After a verification forward (``observes_experts`` only): the experts it executed per MoE layer (sorted
        ids; what the offload model replays), and per block position (``ids`` (L', T, k) CPU tensor, in block order:
        the root, then the drafted tokens as verified; sentinel E = a dropped slot)."""

    def start_pass(self) -> None:
        """Before the first scored prompt of a pass (after the engine's warm-up): forget what the warm-up did."""


@dataclass
class PolicySetup:
    """What a policy may build from once the target and the drafts are loaded (:meth:`EvalPolicy.setup`).

    Attributes:
        target: the :class:`vat.target.FrozenTarget`.
        tok: its tokenizer.
        drafts: the trained drafts (``vat.eval.run.DraftEntry``: label, path, model, ``is_block``); free drafts aside.
        cost: the ``--cost-model`` (:class:`vat.eval.cost.CostModel`), None without one.
        max_new_tokens: tokens generated per turn.
        block: the longest verification block of the run.
        engine: ``engine(draft, hooks)``: a :class:`vat.eval.engine.SpeculativeEngine` of ``draft`` with the run's
            settings (steps, tree, temperature, EOS, tokens per turn) under natural routing, running the given round
            hooks only: what a policy decodes with before the benchmark's passes (EVICT's calibration pass).
    """

    target: Any
    tok: Any
    drafts: list
    cost: Any
    max_new_tokens: int
    block: int
    engine: Callable[[Any, list[RoundPolicy]], Any] | None = None


class EvalPolicy(RoundPolicy):
    """A registered eval policy (:data:`vat.eval.policies.registry.EVAL_POLICIES`); one instance per `vat eval`.

    Class attributes:
        name: its value of ``setting`` (``--tree-policy NAME`` / ``--policy NAME``).
        setting: the :class:`EvalConfig` field that picks it: ``tree_policy`` or ``policy`` (the latter only for a
            rule of :data:`vat.target.budget.POLICIES`).
        summary: one line for `vat eval --help`.
        settings: the EvalConfig fields it reads -> what each one is, for the error when it is set while the policy
            is not picked (None = may be set regardless). eval.json's ``settings`` records each (None unless picked).
        run_keys: top-level eval.json keys it fills (None when it does not run).
        default_budget: ``--budget`` when unset (None = natural routing).
        self_sized: takes ``--budget auto`` (it sizes each window's expert set itself).

    ``__init__`` checks the settings (one :class:`vat.errors.VatError` line, before anything loads).
    """

    name: ClassVar[str] = ""
    setting: ClassVar[str] = "tree_policy"
    summary: ClassVar[str] = ""
    settings: ClassVar[dict[str, str | None]] = {}
    run_keys: ClassVar[tuple[str, ...]] = ()
    default_budget: ClassVar[str | None] = None
    self_sized: ClassVar[bool] = False

    def __init__(self, cfg: Any, tree: Any) -> None:
        self.cfg = cfg  # the EvalConfig
        self.tree = tree  # its parsed TreeSpec, None = chain

    def setup(self, ctx: PolicySetup) -> None:
        """Build what every pass shares (tables, per-draft state) once the target and drafts are loaded."""

    def start_benchmark(self, prompts: list, spec: str) -> None:
        """A benchmark's prompts (those that fit) and its spec (``spec_bench@test``: a dev split may be read beside
        it), before its first pass."""

    def for_pass(self, draft: Any, budget: int | str | None) -> RoundPolicy | None:
        """The hooks of one pass of ``draft`` (a ``DraftEntry``; ``model`` None = the AR pass) under ``budget``
        (None = natural, ``"auto"``, an int); None = the policy leaves this pass alone."""
        return None

    def draft_record(self, draft: Any) -> dict:
        """Keys it adds to the eval.json ``drafts`` entry of ``draft``."""
        return {}

    def run_record(self) -> dict:
        """Its top-level eval.json keys (``run_keys``)."""
        return {}

    def kl_key(self, draft: Any) -> tuple:
        """What, besides (B, window), the KL to natural of ``draft``'s budgeted passes depends on (empty = nothing)."""
        return ()

