"""EcoSpec (docs/verification_policies.md): cost-aware selection of the EAGLE dynamic tree's nodes; lossless.

Confidence-only selection (:func:`vat.eval.tree.best_nodes`) keeps the ``total_tokens`` nodes of highest cumulative
draft log-probability. High-probability siblings often route to disjoint experts ("expert scattering"), which inflates
the verification block's expert union. EcoSpec keeps the tree prefix-closed and picks nodes greedily by

    key(v) = log P(v) − λ · c(v),     c(v) = (1/L') Σ_l Σ_e a_{v,l,e} · Π_{u ∈ block} (1 − a_{u,l,e})

where log P(v) is the node's cumulative draft log-probability (the acceptance score), a_{u,l,e} the predicted
probability that the target routes token u to expert e at MoE layer l when it reads u (the affinity table: the
expert predictor), and the product over the block so far (the root first) is the probability that e is not yet
covered (the expert buffer, soft). c(v) is the expected number of experts per layer node v adds to the block; λ is in
nats per expected new expert per layer. ``exp(key)`` = P(v) · exp(−λ c(v)): a multiplicative cost discount.
At λ = 0 the greedy pick over the frontier is exactly confidence selection (the same nodes in the same order, same
tie-breaks: see :func:`ecospec_nodes`). The verification rule is untouched, so outputs keep the target's distribution.

The cost also enters the expansion (:class:`CostAwareExpansion`): the dynamic tree drafts the children of at most
``top_k`` nodes per level, and EcoSpec picks those by the same key against a buffer of the nodes expanded so far, so
the pool the final selection chooses from already leans toward covered experts.

The root token's routing is not known before the block: the target reads the root for the first time in this very
verification forward (it was the previous round's output), so its experts are predicted like every node's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from vat.data_prep.vocab import target_to_draft_ids
from vat.errors import VatError, require_file
from vat.eval.expert_probe import ExpertProbe, load_probe
from vat.eval.policies import RoundPolicy

AFFINITY_FILE = "affinity.safetensors"  # a vat draft directory's own table (trainer output)


@dataclass
class ExpertPredictor:
    """Token -> per-layer expert probabilities from an affinity table (the expert predictor of EcoSpec).

    Attributes:
        table: (V_rows, L', E) fp32, ``P(e ∈ top-k at layer l | the target reads the row's token)``.
        rows: (V,) int64 table row of every target id, -1 = no row (such tokens read as ``marginal``).
        marginal: (L', E) fp32, the prediction for a token without a row.
        source: where the table came from.
    """

    table: torch.Tensor
    rows: torch.Tensor
    marginal: torch.Tensor
    source: str = ""
    probe: ExpertProbe | None = None

    def __call__(self, target_ids: list[int], hidden: torch.Tensor | None = None) -> torch.Tensor:
        """(n, L', E) fp32 predicted expert probabilities of each token: the table's, or with a probe and the draft
        states that produced the tokens (``hidden`` (n, H)) the probe's, which reads the context."""
        ids = torch.as_tensor(target_ids, dtype=torch.long)
        rows = self.rows[ids.clamp(0, self.rows.numel() - 1)]  # (n,)
        known = (ids >= 0) & (ids < self.rows.numel()) & (rows >= 0)
        out = self.table[rows.clamp_min(0)]  # (n, L', E)
        prior = torch.where(known[:, None, None], out, self.marginal[None])
        if self.probe is None or hidden is None or not len(target_ids):
            return prior
        return self.probe(hidden.to(self.probe.weight.device).float(), prior)

    def nodes(self, pool: list, indices: list[int]) -> torch.Tensor:
        """(n, L', E) predictions for pool nodes (their tokens; with a probe, the states that produced them)."""
        hidden = torch.stack([pool[i].parent_hidden for i in indices]) if self.probe is not None and indices else None
        return self([pool[i].token for i in indices], hidden)

    @classmethod
    def load(cls, path: str, vocab_size: int, t2d: torch.Tensor | None = None) -> ExpertPredictor:
        """Load an affinity table: a draft's ``affinity.safetensors`` (rows = draft ids) or ``vat prep affinity``
        output (rows = target ids, or draft ids when built with ``--vocab``).

        Rows are target ids when the file says so (metadata ``indexed_by``) or when there are V of them; draft ids
        when the file says so or when there are as many as the draft vocab (``t2d`` maps them).

        Args:
            path: the safetensors file, or a draft directory holding ``affinity.safetensors``.
            vocab_size: V, the target vocab.
            t2d: (V,) bool draft-vocab membership of the draft the tree comes from (None: rows must be target ids).
        """
        if os.path.isdir(path):
            path = os.path.join(path, AFFINITY_FILE)
        require_file(path, "affinity table")
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            if "affinity" not in f.keys():
                raise VatError(f"{path} has no `affinity` tensor (keys: {sorted(f.keys())})")
            table = f.get_tensor("affinity").float()
            marginal = f.get_tensor("marginal").float() if "marginal" in f.keys() else None
        if table.dim() != 3:
            raise VatError(f"{path}: `affinity` must be (V_rows, L', E), got shape {tuple(table.shape)}")
        n_rows = table.shape[0]
        indexed_by = meta.get("indexed_by")
        if indexed_by is None:
            if n_rows == vocab_size:
                indexed_by = "target_id"
            elif t2d is not None and n_rows == int(t2d.sum()):
                indexed_by = "draft_id"
        if indexed_by == "target_id" and n_rows == vocab_size:
            rows = torch.arange(vocab_size)
        elif indexed_by == "draft_id" and t2d is not None and n_rows == int(t2d.sum()):
            rows = target_to_draft_ids(t2d.cpu())
        else:
            raise VatError(
                f"affinity table {path} has {n_rows} rows: neither the target vocab ({vocab_size}) nor this draft's "
                f"vocab ({None if t2d is None else int(t2d.sum())}); build one with `vat prep affinity --target ...`"
            )
        if marginal is None:
            marginal = table.mean(0)  # (L', E): a vat draft's table stores no marginal
        return cls(table=table, rows=rows, marginal=marginal, source=path, probe=load_probe(path))


@dataclass
class EcoSpec(RoundPolicy):
    """EcoSpec's node selection for one eval run (a round policy: it chooses the tree's nodes).

    Attributes:
        predictor: the expert predictor.
        lam: λ, nats of draft log-probability one expected new expert per layer is worth (0 = confidence selection).
    """

    predictor: ExpertPredictor
    lam: float = 1.0

    def __post_init__(self) -> None:
        if not self.lam >= 0:
            raise VatError(f"--ecospec-lambda must be >= 0, got {self.lam}")

    def selector(self, root: int):
        """The ``select`` argument of :func:`vat.eval.tree.build_tree` for a block whose root is ``root``."""
        return lambda pool, total: ecospec_nodes(pool, total, self.predictor, root, self.lam)

    def expander(self, root: int):
        """The ``expand`` argument of :func:`vat.eval.tree.build_tree`: cost-aware expansion (:class:`CostAwareExpansion`,
        one per tree, so its expert buffer spans the tree's levels); None at λ = 0 (confidence expansion)."""
        return CostAwareExpansion(self.predictor, root, self.lam) if self.lam > 0 else None


class CostAwareExpansion:
    """EcoSpec's cost during expansion: which of a level's candidates the next draft step expands.

    The same key as the node selection, ``log P(v) − λ · c(v)``, picked greedily (at most ``top_k`` per level): c(v)
    is the expected number of experts per layer v adds to a buffer holding the root's predicted experts and those of
    every node expanded so far in this tree (earlier levels first, then this level's picks in order). At λ = 0 the
    picks are :func:`vat.eval.tree.best_candidates`' (same nodes, same order, same tie-break: the earlier candidate).

    Args:
        predictor: the expert predictor.
        root: the block's root token (target id).
        lam: λ.
    """

    def __init__(self, predictor: ExpertPredictor, root: int, lam: float) -> None:
        self.predictor, self.lam = predictor, lam
        self.miss = 1.0 - predictor([root])[0]  # (L', E) P(expert not yet in the buffer)

    def __call__(self, pool: list, candidates: list[int], top_k: int) -> list[int]:
        if not candidates:
            return []
        probs = self.predictor.nodes(pool, candidates)  # (n, L', E)
        layers = probs.shape[1]
        remaining = list(range(len(candidates)))
        chosen: list[int] = []
        while remaining and len(chosen) < top_k:
            cost = (probs[remaining] * self.miss).sum(dim=(1, 2)) / layers  # (R,) expected new experts per layer
            keys = [(pool[candidates[j]].score - self.lam * float(c), -j) for j, c in zip(remaining, cost.tolist())]
            j = remaining[max(range(len(remaining)), key=keys.__getitem__)]
            chosen.append(candidates[j])
            remaining.remove(j)
            self.miss = self.miss * (1.0 - probs[j])
        return chosen


def ecospec_nodes(pool: list, total: int, predictor: ExpertPredictor, root: int, lam: float) -> list[int]:
    """Greedy prefix-closed selection of ``total`` pool nodes by ``log P − λ · expected new experts per layer``.

    The frontier starts as the root's children; each step takes the frontier node with the best key (ties: the
    shallower, then the earlier pool index: the tie-break of :func:`vat.eval.tree.best_nodes`), multiplies its
    predicted expert probabilities into the buffer's miss probabilities, and opens its children. At λ = 0 the key is the
    score alone and this returns ``best_nodes(pool, total)`` exactly: every node's ancestors rank before it, so the
    global ranking's next node is always on the frontier.

    Args:
        pool: the tree builder's candidate nodes (``token``, ``parent`` pool index or -1, ``depth``, ``score``).
        total: nodes to keep.
        predictor: the expert predictor.
        root: the block's root token (target id).
        lam: λ.

    Returns:
        Pool indices, in the order chosen.
    """
    if not pool or total <= 0:
        return []
    miss = 1.0 - predictor([root])[0]  # (L', E): P(expert not yet loaded by the block), the root's experts predicted
    node_probs = predictor.nodes(pool, list(range(len(pool))))  # (n, L', E)
    layers = node_probs.shape[1]
    children: list[list[int]] = [[] for _ in range(len(pool))]
    frontier = []
    for i, node in enumerate(pool):
        if node.parent < 0:
            frontier.append(i)
        else:
            children[node.parent].append(i)
    chosen: list[int] = []
    while frontier and len(chosen) < total:
        index = torch.tensor(frontier)
        cost = (node_probs[index] * miss).sum(dim=(1, 2)) / layers  # (F,) expected new experts per layer
        keys = [(pool[v].score - lam * float(c), -pool[v].depth, -v) for v, c in zip(frontier, cost.tolist())]
        pick = frontier[max(range(len(frontier)), key=keys.__getitem__)]
        chosen.append(pick)
        frontier.remove(pick)
        frontier += children[pick]
        miss = miss * (1.0 - node_probs[pick])
    return chosen
