"""The eval side of AcceptMoE (``--policy acceptmoe``): each trained draft's commitment estimate p̂_d
(``--commitment``: :func:`vat.eval.commitment.load_commitment`, default the prior 0.8^d) handed to the verification
forwards' budget. The expert-set rule itself is the budget policy ``acceptmoe`` of :mod:`vat.target.budget`, applied
by the router hook inside the target's forward.

Under expert offloading (``--acceptmoe-residency C``, one of ``--offload``'s sizes) each pass also keeps a live
expert cache per MoE layer (:class:`LiveResidency`: the offload model's own :class:`vat.eval.offload.ResidencyCache`,
fed every verification forward's executed experts in order, so it holds what the offload replay of the same pass
holds at each forward) and the budget prunes each verification set against it (the paper's Eq. 6,
:func:`vat.target.budget.prune_nonresident`)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from vat.errors import VatError
from vat.eval.commitment import load_commitment
from vat.eval.offload import OffloadSpec, ResidencyCache
from vat.eval.policies import EvalPolicy, PolicySetup, RoundPolicy
from vat.target.budget import AUTO, AcceptMoESpec, BudgetSpec


class LiveResidency:
    """The GPU-resident experts of one pass, per MoE layer, as the offload model's caches hold them right now.

    Attributes:
        capacity: C, resident experts per layer.
        policy: the eviction policy (``--offload-policy``).
        caches: one :class:`ResidencyCache` per MoE layer, created at the first verification forward.
    """

    def __init__(self, capacity: int, policy: str) -> None:
        self.capacity, self.policy = int(capacity), policy
        self.caches: list[ResidencyCache] = []

    def start_pass(self) -> None:
        """Empty caches (warm-started like the offload model's: the first C experts of each layer fill free slots)."""
        self.caches = []

    def executed(self, expert_sets: list[list[int]], ids=None) -> None:
        """One verification forward's executed experts per layer, in decode order."""
        if not self.caches:
            self.caches = [ResidencyCache(self.capacity, self.policy) for _ in expert_sets]
        for cache, experts in zip(self.caches, expert_sets, strict=True):
            cache.access(experts)

    def resident_experts(self, moe_ordinal: int) -> Collection[int] | None:
        """The layer's resident experts; None while its cache has free slots (a load then evicts nothing)."""
        if moe_ordinal >= len(self.caches):
            return None
        cache = self.caches[moe_ordinal]
        return cache.resident if len(cache.last_use) >= cache.capacity else None


class AcceptMoEBudget(RoundPolicy):
    """The hook of one pass: the budget's commitment weighting.

    Attributes:
        weighting: the draft's :class:`AcceptMoESpec` (p̂, β, anchor, demand).
    """

    def __init__(self, weighting: AcceptMoESpec, residency: LiveResidency | None = None) -> None:
        self.weighting = weighting
        self.residency = residency
        self.observes_experts = residency is not None

    def budget_spec(self, spec: BudgetSpec) -> BudgetSpec:
        """``spec`` with this draft's commitment weighting and the pass's live residency (policy ``acceptmoe`` only)."""
        if spec.policy != "acceptmoe":
            return spec
        return replace(spec, acceptmoe=replace(self.weighting, residency=self.residency))

    def executed(self, expert_sets: list[list[int]], ids=None) -> None:
        """Feeds the live residency (when pruning against one)."""
        if self.residency is not None:
            self.residency.executed(expert_sets)

    def start_pass(self) -> None:
        """Empties the live residency."""
        if self.residency is not None:
            self.residency.start_pass()


class AcceptMoEPolicy(EvalPolicy):
    """AcceptMoE: one :class:`AcceptMoEBudget` per trained draft (free drafts verify under the prior)."""

    name = "acceptmoe"
    setting = "policy"
    summary = ("AcceptMoE (commitment-weighted demand, root anchor, self-sized with --budget auto or |S| = B with an "
               "int; changes the output)")
    settings = {"commitment": "AcceptMoE's estimate", "acceptmoe_residency": "AcceptMoE's residency pruning"}
    default_budget = AUTO
    self_sized = True

    def __init__(self, cfg, tree) -> None:
        super().__init__(cfg, tree)
        self.by_label: dict[str, AcceptMoEBudget] = {}
        self.residency_capacity: int | None = cfg.acceptmoe_residency
        if self.residency_capacity is not None:
            sizes = () if cfg.offload is None else OffloadSpec.parse(cfg.offload).capacities
            if self.residency_capacity not in sizes:
                raise VatError(f"--acceptmoe-residency {self.residency_capacity} prunes against a cache of that many "
                               f"experts: add it to --offload (got {cfg.offload or 'none'}), which prices it")

    def setup(self, ctx: PolicySetup) -> None:
        """Each trained draft's p̂ (its own entry of a ``--commitment`` eval.json, or the list; empty = the prior)."""
        for d in ctx.drafts:
            p_hat = load_commitment(self.cfg.commitment, d.path) if self.cfg.commitment is not None else ()
            self.by_label[d.label] = AcceptMoEBudget(AcceptMoESpec(commitment=p_hat))

    def for_pass(self, draft, budget) -> RoundPolicy | None:
        """The draft's weighting (None for the AR pass and free drafts), with a fresh live residency per pass under
        ``--acceptmoe-residency`` (free drafts then get one too, under the prior)."""
        if self.residency_capacity is None:
            return self.by_label.get(draft.label) if draft.model is not None else None
        if draft.model is None:
            return None  # the AR pass verifies one token: its union always fits
        weighting = self.by_label[draft.label].weighting if draft.label in self.by_label else AcceptMoESpec()
        return AcceptMoEBudget(weighting, LiveResidency(self.residency_capacity, self.cfg.offload_policy))

    def draft_record(self, draft) -> dict:
        """``acceptmoe_commitment``: the p̂ it ran with (empty = the prior 0.8^d)."""
        hook = self.by_label.get(draft.label)
        record = {} if hook is None else {"acceptmoe_commitment": list(hook.weighting.commitment)}
        if self.residency_capacity is not None and draft.model is not None:
            record["acceptmoe_residency"] = self.residency_capacity
        return record

    def kl_key(self, draft) -> tuple:
        """p̂: the budgeted KL forward weighs its window's depths with it."""
        hook = self.by_label.get(draft.label)
        return () if hook is None else (hook.weighting.commitment,)
