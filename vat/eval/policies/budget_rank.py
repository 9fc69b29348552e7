"""``--budget-rank routing`` (an extension of MoE-Spec, docs/verification_policies.md): the budget set of every budgeted
verification forward ranked by the scores the tokens route by instead of the scores that weigh the experts. They
differ only for DeepSeek-V3, whose tokens rank experts by sigmoid + correction bias while the weights (and MoE-Spec's
summed demand, as the paper's rule reads it) use the unbiased sigmoid; :meth:`vat.target.families.FamilyAdapter.scores`."""

from __future__ import annotations

from dataclasses import replace

from vat.eval.policies import EvalPolicy, RoundPolicy
from vat.target.budget import BudgetSpec


class RoutingRank(RoundPolicy):
    """The hook of one pass: its verification forwards' budget ranked by the routing scores."""

    def budget_spec(self, spec: BudgetSpec) -> BudgetSpec:
        """``spec`` with ``rank = routing``."""
        return replace(spec, rank="routing")


class RoutingRankPolicy(EvalPolicy):
    """``--budget-rank routing``: every budgeted pass (and its KL forward) ranks its budget set by the routing scores."""

    name = "routing"
    setting = "budget_rank"
    summary = ("rank the budget set by the scores the tokens route by (DeepSeek-V3's biased sigmoid; an "
               "extension of MoE-Spec, which sums the scores that weigh)")

    def for_pass(self, draft, budget) -> RoundPolicy | None:
        """The hook for a budgeted pass (None at natural routing)."""
        return RoutingRank() if budget is not None else None

    def kl_key(self, draft) -> tuple:
        """The rank changes the budgeted forward."""
        return ("routing",)
