"""Confidence selection (``--tree-policy confidence``, the default): every drafted token is verified, the chain and the
EAGLE tree as drafted (the tree's nodes by cumulative draft log-probability, :func:`vat.eval.tree.best_nodes`)."""

from __future__ import annotations

from vat.eval.policies import EvalPolicy


class Confidence(EvalPolicy):
    """Verify everything drafted: no hook in any pass."""

    name = "confidence"
    summary = "all (the chain / EAGLE tree as drafted)"
