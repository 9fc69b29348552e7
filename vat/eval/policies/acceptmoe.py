"""The eval side of AcceptMoE (``--policy acceptmoe``): each trained draft's commitment estimate p̂_d
(``--commitment``: :func:`vat.eval.commitment.load_commitment`, default the prior 0.8^d) handed to the verification
forwards' budget. The expert-set rule itself is the budget policy ``acceptmoe`` of :mod:`vat.target.budget`, applied
by the router hook inside the target's forward."""

from __future__ import annotations

from dataclasses import replace

from vat.eval.commitment import load_commitment
from vat.eval.policies import EvalPolicy, PolicySetup, RoundPolicy
from vat.target.budget import AUTO, AcceptMoESpec, BudgetSpec


class AcceptMoEBudget(RoundPolicy):
    """The hook of one pass: the budget's commitment weighting.

    Attributes:
        weighting: the draft's :class:`AcceptMoESpec` (p̂, β, anchor, demand).
    """

    def __init__(self, weighting: AcceptMoESpec) -> None:
        self.weighting = weighting

    def budget_spec(self, spec: BudgetSpec) -> BudgetSpec:
        """``spec`` with this draft's commitment weighting (under policy ``acceptmoe`` only)."""
        return replace(spec, acceptmoe=self.weighting) if spec.policy == "acceptmoe" else spec


class AcceptMoEPolicy(EvalPolicy):
    """AcceptMoE: one :class:`AcceptMoEBudget` per trained draft (free drafts verify under the prior)."""

    name = "acceptmoe"
    setting = "policy"
    summary = ("AcceptMoE (commitment-weighted demand, root anchor, self-sized with --budget auto or |S| = B with an "
               "int; changes the output)")
    settings = {"commitment": "AcceptMoE's estimate"}
    default_budget = AUTO
    self_sized = True

    def __init__(self, cfg, tree) -> None:
        super().__init__(cfg, tree)
        self.by_label: dict[str, AcceptMoEBudget] = {}

    def setup(self, ctx: PolicySetup) -> None:
        """Each trained draft's p̂ (its own entry of a ``--commitment`` eval.json, or the list; empty = the prior)."""
        for d in ctx.drafts:
            p_hat = load_commitment(self.cfg.commitment, d.path) if self.cfg.commitment is not None else ()
            self.by_label[d.label] = AcceptMoEBudget(AcceptMoESpec(commitment=p_hat))

    def for_pass(self, draft, budget) -> RoundPolicy | None:
        """The draft's weighting (None for the AR pass and free drafts)."""
        return self.by_label.get(draft.label) if draft.model is not None else None

    def draft_record(self, draft) -> dict:
        """``acceptmoe_commitment``: the p̂ it ran with (empty = the prior 0.8^d)."""
        hook = self.by_label.get(draft.label)
        return {} if hook is None else {"acceptmoe_commitment": list(hook.weighting.commitment)}

    def kl_key(self, draft) -> tuple:
        """p̂: the budgeted KL forward weighs its window's depths with it."""
        hook = self.by_label.get(draft.label)
        return () if hook is None else (hook.weighting.commitment,)
