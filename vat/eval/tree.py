"""EAGLE dynamic draft trees (EAGLE-2 / EAGLE-3 inference): build, lay out for verification, walk for acceptance.

Building (``top_k``, ``depth``, ``total_tokens``):

1. the root's children are the draft's top-k tokens after the root, scored by their log-probability;
2. at each further depth, the top-k highest-scoring nodes of the newest level are expanded in ONE draft step (one
   entry per node, tree attention over the draft cache), each contributing its top-k children with cumulative
   score = parent score + log q(child);
3. the ``total_tokens`` best nodes of every level are kept (cumulative scores only decrease along a path and ties are
   broken by depth, so the kept set always contains each kept node's ancestors).

Verification runs ``[root, nodes...]`` (topological order) with position ``n + depth`` and a 4-D mask letting each
entry see the cache and its own ancestors. Acceptance walks from the root: greedy follows the child equal to the
target's argmax; sampling tries children in the draft's order (:func:`vat.eval.sampling.accept_children_sampling`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vat.errors import VatError
from vat.eval.draft_state import DraftHead, DraftState
from vat.eval.sampling import accept_children_sampling, sample, target_probs


@dataclass
class TreeSpec:
    """Shape of the dynamic tree: ``top_k`` children per expanded node, ``depth`` levels, ``total_tokens`` nodes
    (drafted nodes, the root excluded: the verification block is ``total_tokens + 1``)."""

    top_k: int
    depth: int
    total_tokens: int

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """``"top_k,depth,total_tokens"`` -> :class:`TreeSpec`."""
        parts = [p.strip() for p in str(text).split(",")]
        try:
            top_k, depth, total = (int(p) for p in parts)
        except ValueError:
            raise VatError(f"--tree takes top_k,depth,total_tokens (three integers), got `{text}`") from None
        if min(top_k, depth, total) < 1:
            raise VatError(f"--tree values must be >= 1, got `{text}`")
        return cls(top_k, depth, total)


@dataclass
class DraftTree:
    """A drafted tree in topological order; node i sits at verification-block index i + 1 (the root is index 0).

    Attributes:
        tokens: node tokens (target vocabulary).
        parents: parent node index per node, -1 = the root.
        depths: 1-based depth per node.
        scores: cumulative draft log-probability per node.
        vh: verification-head probability at the hidden state that drafted each node (None without a head).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    vh: list[float] | None = None
    drafted_depth: int = 0  # levels the draft drafted (its forwards), whatever the selection kept

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        """Children of each block entry (index 0 = root), as block indices in the draft's order (best first)."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i + 1)
        for k in kids:
            k.sort(key=lambda b: -self.scores[b - 1])
        return kids

    def ancestors(self) -> torch.Tensor:
        """(N + 1, N + 1) bool over block entries: ``[i, j]`` = j is i or an ancestor of i."""
        n = len(self) + 1
        anc = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            anc[i + 1] |= anc[parent + 1]  # parents come first, so their rows are complete
        return anc

    def block_depths(self) -> torch.Tensor:
        """(N + 1,) depth per block entry (root 0)."""
        return torch.tensor([0] + self.depths, dtype=torch.long)


@dataclass
class _Node:
    token: int
    parent: int  # pool index, -1 = root
    depth: int
    score: float
    parent_hidden: torch.Tensor  # (H,) draft hidden that produced this node
    slot: int = -1  # draft-cache slot of the node's own entry, once expanded
    vh: float | None = None  # verification-head probability at parent_hidden (None without a head)


def _ancestor_slots(pool: list[_Node], v: int) -> list[int]:
    slots = []
    u = pool[v].parent
    while u >= 0:
        slots.append(pool[u].slot)
        u = pool[u].parent
    return slots


def _add_children(
    pool: list[_Node], parent: int, logits: torch.Tensor, hidden: torch.Tensor, base: float, depth: int,
    state: DraftState, top_k: int, vh: float | None = None,
) -> list[int]:
    """Add the top-k children of ``parent`` (pool index or -1) from its draft logits (V_d,); ``vh`` = the head's
    probability at ``hidden``."""
    logp = torch.log_softmax(state.scaled_logits(logits), dim=-1)  # (V_d,)
    values, draft_ids = logp.topk(min(top_k, logp.shape[-1]))
    tokens = state.to_target_ids(draft_ids)
    added = []
    for value, token in zip(values.tolist(), tokens.tolist()):
        pool.append(_Node(token=token, parent=parent, depth=depth, score=base + value, parent_hidden=hidden, vh=vh))
        added.append(len(pool) - 1)
    return added


def _vh_prob(vh_logit: float | None) -> float:
    return 1.0 if vh_logit is None else 1.0 / (1.0 + math.exp(-vh_logit))


@torch.no_grad()
def build_tree(
    state: DraftState, head: DraftHead, spec: TreeSpec, vh_threshold: float | None = None,
    select: Callable[[list[_Node], int], list[int]] | None = None,
    expand: Callable[[list[_Node], list[int], int], list[int]] | None = None,
) -> DraftTree:
    """Draft a dynamic tree from the head (speculative draft-cache entries are cropped before returning).

    Args:
        state: the draft state.
        head: the draft's output at the newest committed entry (its logits give the root's children).
        spec: top_k, depth, total_tokens.
        vh_threshold: do not expand a node whose verification-head probability is below this (None = never).
        select: which ``total_tokens`` pool nodes to keep (pool indices, ancestor-closed); None = the best by
            cumulative score (:func:`best_nodes`). EcoSpec (:mod:`vat.eval.ecospec`) passes its own.
        expand: which of a level's candidates (pool indices) the next draft step expands, at most ``top_k`` of them;
            None = the best by cumulative score (:func:`best_candidates`). EcoSpec passes its cost-aware one.

    Returns:
        The :class:`DraftTree` (possibly empty).
    """
    threshold = vh_threshold if vh_threshold is not None else -1.0
    pool: list[_Node] = []
    if _vh_prob(head.vh_logit) < threshold:
        return DraftTree()
    prefix = state.cache.length
    root_vh = None if head.vh_logit is None else _vh_prob(head.vh_logit)
    frontier = _add_children(pool, -1, head.logits, head.hidden, 0.0, 1, state, spec.top_k, root_vh)
    for depth in range(2, spec.depth + 1):
        if not frontier:
            break
        frontier = _expand(state, head, pool, frontier, prefix, depth, spec.top_k, threshold,
                           expand or best_candidates)
    state.cache.crop(prefix)
    tree = tree_of(pool, (select or best_nodes)(pool, spec.total_tokens))
    tree.drafted_depth = max((node.depth for node in pool), default=0)  # the cost model prices these forwards
    return tree


def _expand(
    state: DraftState, head: DraftHead, pool: list[_Node], frontier: list[int], prefix: int, depth: int,
    top_k: int, threshold: float, choose: Callable[[list[_Node], list[int], int], list[int]],
) -> list[int]:
    """Run one draft step over the frontier nodes (depth - 1) and return the next frontier (depth)."""
    cache = state.cache
    S, n = cache.length, len(frontier)
    device = head.hidden.device
    mask = torch.zeros(1, n, S + n, dtype=torch.bool, device=device)  # (1, n, S + n); self added by step()
    mask[0, :, :prefix] = cache.valid[0, :prefix]
    for i, v in enumerate(frontier):
        mask[0, i, _ancestor_slots(pool, v)] = True
    tokens = torch.tensor([[pool[v].token for v in frontier]], device=device)  # (1, n)
    hidden = torch.stack([pool[v].parent_hidden for v in frontier])[None]  # (1, n, H)
    positions = torch.full((1, n), head.position + depth - 1, dtype=torch.long, device=device)
    out = state.drafter.step(cache, tokens, hidden=hidden, position_ids=positions, attention_mask=mask)
    candidates: list[int] = []
    for i, v in enumerate(frontier):
        pool[v].slot = S + i
        vh = None if out.vh_logits is None else float(out.vh_logits[0, i])
        if _vh_prob(vh) < threshold:
            continue
        candidates += _add_children(pool, v, out.logits[0, i], out.hidden[0, i], pool[v].score, depth, state, top_k,
                                    None if vh is None else _vh_prob(vh))
    return choose(pool, candidates, top_k)


def best_candidates(pool: list[_Node], candidates: list[int], top_k: int) -> list[int]:
    """The ``top_k`` candidates of best cumulative score (ties: the earlier candidate), best first."""
    return sorted(candidates, key=lambda c: -pool[c].score)[:top_k]


def best_nodes(pool: list[_Node], total: int) -> list[int]:
    """The ``total`` best pool nodes by cumulative score (ties: shallower, then earlier), best first.

    Ancestor-closed: a child's score is at most its parent's, and a tie goes to the shallower node."""
    return sorted(range(len(pool)), key=lambda i: (-pool[i].score, pool[i].depth, i))[:total]


def _select(pool: list[_Node], total: int) -> DraftTree:
    """Keep the ``total`` best nodes (ancestor-closed), re-indexed in topological order."""
    return tree_of(pool, best_nodes(pool, total))


def tree_of(pool: list[_Node], chosen: list[int]) -> DraftTree:
    """The :class:`DraftTree` of the ``chosen`` pool nodes (ancestor-closed), re-indexed in topological order."""
    order = sorted(chosen, key=lambda i: (pool[i].depth, i))
    new_index = {old: new for new, old in enumerate(order)}
    tree = DraftTree()
    for old in order:
        node = pool[old]
        tree.tokens.append(node.token)
        tree.parents.append(new_index[node.parent] if node.parent >= 0 else -1)
        tree.depths.append(node.depth)
        tree.scores.append(node.score)
    if order and all(pool[i].vh is not None for i in order):
        tree.vh = [pool[i].vh for i in order]
    return tree


@dataclass
class TreeVerdict:
    """Outcome of verifying a tree.

    Attributes:
        path: accepted block indices, root first (``len(path) - 1`` drafts accepted).
        next_token: the token the target commits after the path (correction or bonus).
        reached: draft positions (depths) the walk reached: accepted depths, plus one if the last accepted entry had
            children that were tried.
    """

    path: list[int]
    next_token: int
    reached: int


def judge_tree(
    logits: torch.Tensor, tree: DraftTree, temperature: float, generator: torch.Generator | None = None
) -> TreeVerdict:
    """Walk the tree from the root with the verification logits.

    Args:
        logits: (N + 1, V) target logits of the block ``[root, nodes...]``.
        tree: the drafted tree.
        temperature: 0 = greedy, else tree rejection sampling at this temperature.
        generator: randomness.

    Returns:
        A :class:`TreeVerdict`.
    """
    kids = tree.children()
    path = [0]
    while True:
        b = path[-1]
        options = kids[b]
        if temperature <= 0:
            best = int(logits[b].argmax())
            match = [c for c in options if tree.tokens[c - 1] == best]
            if match:
                path.append(match[0])
                continue
            return TreeVerdict(path=path, next_token=best, reached=len(path) - 1 + bool(options))
        p = target_probs(logits[b], temperature)  # (V,)
        index, residual = accept_children_sampling(p, [tree.tokens[c - 1] for c in options], generator)
        if index is not None:
            path.append(options[index])
            continue
        return TreeVerdict(path=path, next_token=sample(residual, generator), reached=len(path) - 1 + bool(options))
