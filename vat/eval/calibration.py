"""Calibrated acceptance for EVICT (docs/eval.md, "EVICT"): how often a drafted node is really accepted, per depth and
confidence bin, fitted on prompts the evaluation does not score.

EVICT ranks drafted nodes by an acceptance estimate P and keeps the prefix with the most expected accepted tokens per
modeled cost, so P must be a probability of acceptance, not a score. The raw estimates are not: a draft's path
probability Π q at temperature 0 is far below the chance its path survives greedy verification (a confident draft
that is usually right still spreads mass over near-synonyms), and a verification head is trained on another target
state. The calibration maps a raw estimate to the observed frequency of acceptance of nodes like it:

    P_cal(d, p) = (a[d, b(p)] + α · r_d) / (n[d, b(p)] + α),    r_d = (a[d] + α · r) / (n[d] + α)

where ``n[d, b]`` counts the depth-d nodes whose raw estimate fell in bin b, ``a[d, b]`` how many of them the
verification accepted (the node and all its ancestors: it lies on the committed path), ``r_d`` the depth's pooled
rate shrunk towards the overall rate ``r``, and α a prior strength (pseudo-observations): an empty bin gets its depth's
rate, an empty depth the overall rate. Depths past the deepest observed one use the deepest. The raw estimate is the
one :mod:`vat.eval.evict` reads (path probability, or the head's survival), so calibration only re-labels it; the
estimates stay monotone along paths after the map (EVICT re-applies ``min`` with the parent).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from vat.eval.policies import RoundPolicy

# bin edges over the raw estimate in [0, 1]: finer near 0, where path probabilities of deeper nodes live
DEFAULT_EDGES = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95, 1.0)
PRIOR_STRENGTH = 4.0  # α: pseudo-observations of the depth's (then the overall) rate in every bin


@dataclass
class AcceptanceCalibration:
    """Counts of drafted nodes by (depth, raw-estimate bin) and how many were accepted.

    Attributes:
        edges: bin edges over the raw estimate (increasing, 0 to 1): bin b holds ``edges[b] <= p < edges[b + 1]``
            (1.0 falls in the last bin).
        seen: ``seen[d - 1][b]`` drafted nodes at depth d in bin b.
        accepted: ``accepted[d - 1][b]`` of them on the committed path.
        prior: α, the prior strength of :func:`rate`.
        source: where the counts came from (prompts, draft).
    """

    edges: tuple[float, ...] = DEFAULT_EDGES
    seen: list[list[int]] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    prior: float = PRIOR_STRENGTH
    source: str = ""

    def bin(self, p: float) -> int:
        """The bin of raw estimate ``p`` (clamped into [0, 1])."""
        p = min(max(float(p), 0.0), 1.0)
        return min(bisect.bisect_right(self.edges, p) - 1, len(self.edges) - 2)

    def record(self, depths: Sequence[int], raw: Sequence[float], accepted: Sequence[int]) -> None:
        """One verification round: every drafted node's depth (1-based) and raw estimate, and the indices of the
        nodes the verification accepted."""
        taken = set(accepted)
        nbins = len(self.edges) - 1
        for i, (d, p) in enumerate(zip(depths, raw)):
            while len(self.seen) < d:
                self.seen.append([0] * nbins)
                self.accepted.append([0] * nbins)
            b = self.bin(p)
            self.seen[d - 1][b] += 1
            self.accepted[d - 1][b] += int(i in taken)

    @property
    def nodes(self) -> int:
        """Nodes recorded."""
        return sum(map(sum, self.seen))

    def overall_rate(self) -> float | None:
        """Accepted / seen over every node (None before any)."""
        n = self.nodes
        return sum(map(sum, self.accepted)) / n if n else None

    def depth_rate(self, depth: int) -> float | None:
        """The depth's pooled rate, shrunk towards the overall one (None before any node)."""
        overall = self.overall_rate()
        if overall is None:
            return None
        d = min(depth, len(self.seen)) - 1
        return (sum(self.accepted[d]) + self.prior * overall) / (sum(self.seen[d]) + self.prior)

    def rate(self, depth: int, raw: float) -> float:
        """The calibrated acceptance probability of a depth-``depth`` node with raw estimate ``raw`` (the raw
        estimate itself before anything was recorded)."""
        prior = self.depth_rate(depth)
        if prior is None:
            return float(raw)
        d, b = min(depth, len(self.seen)) - 1, self.bin(raw)
        return (self.accepted[d][b] + self.prior * prior) / (self.seen[d][b] + self.prior)

    def calibrate(self, depths: Sequence[int], raw: Sequence[float]) -> list[float]:
        """:func:`rate` of every node."""
        return [self.rate(d, p) for d, p in zip(depths, raw)]

    def to_dict(self) -> dict:
        """JSON-ready counts (eval.json ``evict_profile.calibration``), with the rates per depth and bin."""
        return {"edges": list(self.edges), "seen": self.seen, "accepted": self.accepted, "prior": self.prior,
                "source": self.source, "nodes": self.nodes, "overall_rate": self.overall_rate(),
                "rate": [[round(self.rate(d + 1, (lo + hi) / 2), 4) for lo, hi in zip(self.edges, self.edges[1:])]
                         for d in range(len(self.seen))]}

    @classmethod
    def from_dict(cls, data: dict) -> AcceptanceCalibration:
        """The inverse of :meth:`to_dict` (derived keys ignored)."""
        return cls(edges=tuple(data["edges"]), seen=[list(r) for r in data["seen"]],
                   accepted=[list(r) for r in data["accepted"]], prior=float(data.get("prior", PRIOR_STRENGTH)),
                   source=data.get("source", ""))


class CalibrationRecorder(RoundPolicy):
    """The round hooks of a calibration pass: every chain, block or tree verified uncut, its nodes' raw estimates
    recorded with what the verification accepted.

    Attributes:
        calibration: the :class:`AcceptanceCalibration` filled.
        raw_of_tree: raw estimates of a tree's nodes (:func:`vat.eval.evict.tree_probs`).
        raw_of_chain: raw estimates of a chain's positions (:func:`vat.eval.evict.chain_probs`).
    """

    def __init__(self, calibration: AcceptanceCalibration, raw_of_tree, raw_of_chain) -> None:
        self.calibration = calibration
        self.raw_of_tree, self.raw_of_chain = raw_of_tree, raw_of_chain
        self._pending: tuple[list[int], list[float]] | None = None

    def cut_chain(self, draft, context: int, mode: str):
        """Record the chain's positions (depth i + 1) and keep it whole."""
        raw = self.raw_of_chain(draft)
        self._pending = (list(range(1, len(raw) + 1)), raw) if raw else None
        return draft

    def cut_tree(self, tree, context: int, top_k: int):
        """Record the tree's nodes and keep it whole."""
        self._pending = (list(tree.depths), self.raw_of_tree(tree)) if len(tree) else None
        return tree

    def observe(self, accepted: list[int]) -> None:
        """The nodes the verification accepted: count the pending round."""
        if self._pending is not None:
            self.calibration.record(*self._pending, accepted)
        self._pending = None
