"""EVICT (docs/eval.md): lossless truncation of a draft chain or tree before verification.

Each drafted node i gets an acceptance estimate P_i: the drafter's path probability (the product of the draft's
probabilities along the path: ``exp(score)`` of a tree node), or, for a draft with a verification head, the head's
survival probability (it is trained against "every draft up to here accepted", docs/vat_losses.md) read at the hidden state
that drafted the node, scaled for a tree's non-top-1 children by q(child) / q(top-1 sibling). A node is never accepted
without its parent, so P is made monotone along every path: P_i ← min(P_i, P_parent). Ranking the nodes by P (ties:
shallower first) then makes every top-n set prefix-closed, and EVICT keeps

    n* = argmax_n  (1 + Σ_{i≤n} P_(i)) / (T_draft + C_verify(n))

nodes (n = 0 verifies the root alone: a one-token round). With a calibration (:mod:`vat.eval.calibration`, fitted by
a pass over prompts the evaluation does not score) each raw P_i is first replaced by the observed acceptance rate of
nodes of its depth and raw-estimate bin: a path probability is a score, not the chance of acceptance. C_verify(n) is
the modeled time of verifying n + 1 tokens (:mod:`vat.eval.cost`) with the expert union the offline profile measured
at that width on the target's own text (:mod:`vat.eval.verify_cost`), at the round's context; T_draft is the modeled time of the round's draft forwards.
Since the benefit only grows and the cost depends on n alone, the top-n set is the best set of each size, so the
argmax over n is the argmax over every prefix-closed subset. Truncation only removes drafts: greedy verification of
the kept nodes commits exactly the target's tokens, and rejection sampling over the kept children stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vat.eval.calibration import AcceptanceCalibration
from vat.eval.chain import ChainDraft
from vat.eval.cost import CostModel, ModelShape, draft_forwards
from vat.eval.policies import RoundPolicy
from vat.eval.tree import DraftTree
from vat.eval.verify_cost import VerifyCostTable


def monotone(probs: Sequence[float], parents: Sequence[int]) -> list[float]:
    """P_i ← min(P_i, P_parent) in topological order (parents before children; -1 = the root)."""
    out: list[float] = []
    for p, parent in zip(probs, parents):
        out.append(min(float(p), out[parent]) if parent >= 0 else float(p))
    return out


def evict_select(probs: Sequence[float], parents: Sequence[int], depths: Sequence[int],
                 verify_seconds: Callable[[int], float], draft_seconds: float) -> list[int]:
    """The nodes EVICT keeps, as sorted node indices (prefix-closed).

    Args:
        probs: acceptance estimate P_i per node (made monotone along paths here).
        parents: parent node index per node (-1 = the root); parents come first.
        depths: 1-based depth per node (tie-break: shallower first).
        verify_seconds: C_verify(n): the cost of verifying n drafted nodes plus the root.
        draft_seconds: T_draft, the round's drafting time.

    Returns:
        The kept node indices, increasing.
    """
    eff = monotone(probs, parents)
    order = sorted(range(len(eff)), key=lambda i: (-eff[i], depths[i], i))
    best_n, best, gain = 0, -math.inf, 1.0
    for n in range(len(order) + 1):
        if n:
            gain += eff[order[n - 1]]
        ratio = gain / (draft_seconds + verify_seconds(n))
        if ratio > best:
            best_n, best = n, ratio
    return sorted(order[:best_n])


def subtree(tree: DraftTree, keep: Sequence[int]) -> DraftTree:
    """The prefix-closed subset ``keep`` (node indices, increasing) of a tree, re-indexed (topological order kept)."""
    index = {old: new for new, old in enumerate(keep)}
    out = DraftTree()
    for old in keep:
        parent = tree.parents[old]
        out.tokens.append(tree.tokens[old])
        out.parents.append(index[parent] if parent >= 0 else -1)
        out.depths.append(tree.depths[old])
        out.scores.append(tree.scores[old])
    if getattr(tree, "vh", None) is not None:
        out.vh = [tree.vh[i] for i in keep]
    out.drafted_depth = tree.drafted_depth
    return out


def tree_probs(tree: DraftTree) -> list[float]:
    """P per tree node: exp(score) (path probability), or with a verification head its survival probability at the
    drafting hidden state, scaled by q(node) / q(best sibling)."""
    vh = getattr(tree, "vh", None)
    if vh is None:
        return [math.exp(s) for s in tree.scores]
    best: dict[int, float] = {}
    for parent, score in zip(tree.parents, tree.scores):
        best[parent] = max(best.get(parent, -math.inf), score)
    return [v * math.exp(s - best[p]) for v, s, p in zip(vh, tree.scores, tree.parents)]


def chain_probs(draft: ChainDraft) -> list[float]:
    """P per chain position: Π_{j≤i} q_j(d_j), or the verification head's survival probability when recorded."""
    if draft.vh is not None:
        return list(draft.vh)
    out, p = [], 1.0
    for q in draft.probs or []:
        p *= q
        out.append(p)
    return out


@dataclass
class Evict(RoundPolicy):
    """EVICT as the engine applies it (a round policy: it cuts chains, blocks and trees).

    Attributes:
        cost: the cost model (accelerator, target shape, served dtype).
        table: the verification-cost profile (union per width).
        draft: the draft's shape (its forwards' time is T_draft).
        budget: the verification's expert budget B (an int caps the profiled union per layer at B; None = natural).
        calibration: maps each node's raw estimate to the observed acceptance rate of nodes of its depth and
            confidence (:mod:`vat.eval.calibration`); None = the raw estimates as they are.
    """

    cost: CostModel
    table: VerifyCostTable
    draft: ModelShape | None = None
    budget: int | None = None
    calibration: AcceptanceCalibration | None = None

    def estimates(self, depths: Sequence[int], raw: Sequence[float]) -> list[float]:
        """P per node: the raw estimates, calibrated when a calibration is set."""
        return list(raw) if self.calibration is None else self.calibration.calibrate(depths, raw)

    def union(self, width: int) -> list[float]:
        """Expected experts per MoE layer when verifying ``width`` tokens (the profile's, capped by the budget)."""
        union = self.table.union_at(width)
        return union if self.budget is None else [min(u, float(self.budget)) for u in union]

    def _verify(self, context: int) -> Callable[[int], float]:
        return lambda n: self.cost.verify(n + 1, context, self.union(n + 1))

    def cut_tree(self, tree: DraftTree, context: int, top_k: int) -> DraftTree:
        """Truncate a drafted tree (``context``: the target's cached positions before the block)."""
        if not len(tree):
            return tree
        t_draft = self.cost.draft(self.draft, draft_forwards("tree", max(tree.drafted_depth, max(tree.depths)), top_k),
                                  context)
        probs = self.estimates(tree.depths, tree_probs(tree))
        keep = evict_select(probs, tree.parents, tree.depths, self._verify(context), t_draft)
        return tree if len(keep) == len(tree) else subtree(tree, keep)

    def cut_chain(self, draft: ChainDraft, context: int, mode: str = "chain") -> ChainDraft:
        """Truncate a drafted chain (EAGLE-3 chain or DFlash block: ``mode`` ``chain`` / ``block``)."""
        k = int(draft.tokens.shape[0])
        if k == 0 or (draft.probs is None and draft.vh is None):
            return draft
        t_draft = self.cost.draft(self.draft, draft_forwards(mode, k), context)
        depths = list(range(1, k + 1))
        keep = evict_select(self.estimates(depths, chain_probs(draft)), list(range(-1, k - 1)), depths,
                            self._verify(context), t_draft)
        return draft.prefix(len(keep))  # a chain's prefix-closed sets are its prefixes


def token_prob(logits: torch.Tensor, token: torch.Tensor) -> float:
    """The draft's probability of ``token`` under softmax(logits) (V_d,) -> float."""
    return float(torch.softmax(logits.float(), dim=-1)[token].reshape(()))
