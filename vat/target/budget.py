"""Expert budgeting (MoE-Spec, docs/verification_policies.md): per window, keep only B experts per MoE layer.

Pure tensor functions, applied by the router hook in :mod:`vat.target.routing`:

1. :func:`window_groups` assigns every token of a forward to a budget window (a group id), or -1 (unbudgeted);
2. :func:`budget_sets` picks each window's expert set S per layer: the window's natural union when it fits in B
   (so B >= union leaves the model bit-identical), else the top-B experts by summed routing score;
3. :func:`apply_budget` reroutes (``substitute``) or drops (``truncate``, ``truncate_cover``) the out-of-budget
   slots, keeping each family's own weighting rule through its :class:`~vat.target.families.FamilyAdapter`.

``truncate`` is MoE-Spec's truncation as its paper defines it: an expert outside S gets zero weight and the kept
weights stay as the router gave them, so a token none of whose natural top-k experts is in S ("uncovered") gets no
expert output at all. ``truncate_cover`` is vat's earlier hybrid, kept under its own name: the kept weights are
rescaled to the natural total and an uncovered token is substituted instead. Every policy counts the uncovered tokens
(``TargetOutput.n_uncovered``).

Policy ``acceptmoe`` (AcceptMoE, docs/verification_policies.md; an eval-time verifier policy, not a training one) is the same
hook with another selection: per window, commitment-weighted demand u_e = Σ_t α_t r_{t,e} 1[e ∈ K_t] with
α_t = p̂_{d_t}^β · N_{d_t}^{-1/2} (:func:`commitment_weights`, from each token's depth in its window), the eligible set
S = A ∪ top-n(R) (A = the root's natural top-k, R = the other experts ranked by u; n = ⌈exp(entropy of u over R)⌉
self-sized, or fixed by an integer B = |S| for "AcceptMoE-fix"), then substitution inside S. MoE-Spec's selection is
the special case α ≡ 1, demand over every expert's score, no anchor, |S| = B: both go through :func:`budget_sets`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vat.config import DEFAULT_BUDGET_POLICY, TRAINING_BUDGET_POLICIES
from vat.errors import VatError
from vat.target.families import FamilyAdapter

TRAINING_POLICIES = TRAINING_BUDGET_POLICIES  # the policies `budget.policy` of a recipe takes
POLICIES = TRAINING_POLICIES + ("acceptmoe",)  # + AcceptMoE: eval only (its commitment estimate comes from a draft's eval)
SCOPES = ("sequence", "batch")
AUTO = "auto"  # B of a self-sized policy (acceptmoe): the policy picks |S| per window and layer
DEMANDS = ("natural", "score")
RANKS = ("weights", "routing")  # which scores rank the budget set (FamilyAdapter.scores); they differ for DeepSeek-V3
DEFAULT_COMMITMENT_DECAY = 0.8  # p̂_d = 0.8^d when no offline estimate is given (EAGLE-3's own step-weight prior)
SIZE_TOLERANCE = 1e-6  # ⌈exp(H) - tol⌉: a uniform demand over m experts gives exactly m despite rounding


class Residency(Protocol):
    """What AcceptMoE's residency pruning reads: the experts resident on the GPU at one MoE layer right now."""

    def resident_experts(self, moe_ordinal: int) -> Collection[int] | None:
        """The resident expert ids of MoE layer ``moe_ordinal``; None = the layer's cache still has free slots (a
        non-resident expert then costs no eviction, and nothing is pruned)."""


@dataclass
class AcceptMoESpec:
    """AcceptMoE's commitment weighting (docs/verification_policies.md), the selection of policy ``acceptmoe``.

    Attributes:
        commitment: p̂_d for draft depth d = 1, 2, ...: the offline-estimated probability that a node at depth d
            ends on the accepted path (e.g. a draft's acceptance by position). Depth 0 (the root) is 1; depths past
            the list reuse its last value. Empty = the prior ``0.8^d``.
        beta: β of α = p̂^β · N^{-1/2} (the paper's 0.5).
        anchor: always keep the root's natural top-k (the paper's A). False is for comparisons only.
        demand: ``natural`` (u_e counts a token's score only for its own natural top-k: the paper) or ``score``
            (every expert's score, MoE-Spec's sum). ``score`` is for comparisons only.
        residency: the live expert cache of an offloaded target (:class:`Residency`): when set, each window's S is
            pruned of its least-demanded non-resident experts (:func:`prune_nonresident`, the paper's Eq. 6).
    """

    commitment: tuple[float, ...] = ()
    beta: float = 0.5
    anchor: bool = True
    demand: str = "natural"
    residency: Residency | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.commitment = tuple(float(p) for p in self.commitment)
        if any(not 0.0 <= p <= 1.0 for p in self.commitment):
            raise VatError(f"commitment probabilities must lie in [0, 1], got {list(self.commitment)}")
        if self.beta < 0:
            raise VatError(f"acceptmoe beta must be >= 0, got {self.beta}")
        if self.demand not in DEMANDS:
            raise VatError(f"unknown acceptmoe demand `{self.demand}`: one of {', '.join(DEMANDS)}")

    def p_hat(self, max_depth: int) -> torch.Tensor:
        """(max_depth + 1,) float64 p̂_d for d = 0..max_depth (p̂_0 = 1)."""
        depths = torch.arange(max_depth + 1, dtype=torch.float64)
        if not self.commitment:
            return DEFAULT_COMMITMENT_DECAY ** depths
        table = torch.tensor((1.0,) + self.commitment, dtype=torch.float64)
        return table[depths.long().clamp_max(len(table) - 1)]

    def resident_mask(self, moe_ordinal: int, num_experts: int, device: torch.device) -> torch.Tensor | None:
        """(E,) bool resident experts of one MoE layer, or None (no residency, or a cache with free slots)."""
        if self.residency is None:
            return None
        resident = self.residency.resident_experts(moe_ordinal)
        if resident is None:
            return None
        mask = torch.zeros(num_experts, dtype=torch.bool, device=device)
        ids = [int(e) for e in resident if 0 <= int(e) < num_experts]
        if ids:
            mask[torch.tensor(ids, device=device)] = True
        return mask


@dataclass
class BudgetSpec:
    """Where and how hard to budget a forward.

    Attributes:
        B: experts kept per MoE layer per window: an int, a list indexed by MoE-layer ordinal, or a mapping
            ``{decoder layer index: B}`` (layers absent from the mapping are not budgeted).
        policy: ``substitute`` (rerun each token's own top-k inside the budget set), ``truncate`` (MoE-Spec: drop
            the out-of-budget slots, zero weight), ``truncate_cover`` (drop them, rescale the kept weights to the
            original total, substitute a token left without experts) or ``acceptmoe`` (eval only).
        window: window length W in positions; None = every row's tokens of this forward form one window
            (the verification block).
        offset: windows are ``[offset + jW, offset + (j+1)W)`` in absolute positions (positions before the
            offset form a first, shorter window). Unused when ``phase`` is set.
        phase: per-row window phase φ_r in ``[0, W)`` (scope ``sequence``; the trainer's ``budget.align:
            response``): windows restart at the first position ``s`` of every run of budgeted positions of a row (a
            response segment: at serving, each turn's first verification block starts there) and are
            ``[s, s + φ_r)`` (empty when φ_r = 0) then ``[s + φ_r + jW, s + φ_r + (j+1)W)``, cut at the segment's
            end. None = the absolute tiling from ``offset``.
        scope: ``sequence`` (each row has its own windows) or ``batch`` (all rows of the forward share them).
        start_position: positions before this are not budgeted (the prompt's prefill stays natural).
        acceptmoe: the commitment weighting of policy ``acceptmoe`` (default :class:`AcceptMoESpec`); with that
            policy B may be ``"auto"`` (self-sized S) or an int (|S| fixed: AcceptMoE-fix).
        rank: the scores a window's demand sums: ``weights`` (the paper's: the router's probabilities, DeepSeek-V3's
            unbiased scores) or ``routing`` (the scores the tokens route by: DeepSeek-V3's biased ones, an extension).
    """

    B: Any
    policy: str = DEFAULT_BUDGET_POLICY
    window: int | None = None
    offset: int = 0
    scope: str = "sequence"
    start_position: int = 0
    acceptmoe: AcceptMoESpec | None = None
    phase: tuple[int, ...] | None = None
    rank: str = "weights"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise VatError(f"unknown budget policy `{self.policy}`: one of {', '.join(POLICIES)}")
        if self.rank not in RANKS:
            raise VatError(f"unknown budget rank `{self.rank}`: one of {', '.join(RANKS)}")
        if self.policy == "acceptmoe" and self.acceptmoe is None:
            self.acceptmoe = AcceptMoESpec()
        if self.B == AUTO and self.policy != "acceptmoe":
            raise VatError(f"budget `{AUTO}` (a self-sized expert set) needs policy acceptmoe, not `{self.policy}`")
        if self.scope not in SCOPES:
            raise VatError(f"unknown budget scope `{self.scope}`: one of {', '.join(SCOPES)}")
        if self.window is not None and self.window < 1:
            raise VatError(f"budget window must be >= 1, got {self.window}")
        if self.phase is not None:
            self.phase = tuple(int(p) for p in self.phase)
            if self.window is None or self.scope != "sequence":
                raise VatError("a per-row budget window phase needs a window length and scope `sequence`")
            if any(not 0 <= p < self.window for p in self.phase):
                raise VatError(f"budget window phases must lie in [0, {self.window}), got {list(self.phase)}")

    @property
    def self_sized(self) -> bool:
        """True when the policy sizes each window's expert set itself (acceptmoe with B ``"auto"``)."""
        return self.B == AUTO

    def budget_for(self, layer_idx: int, moe_ordinal: int) -> int | None:
        """B for one MoE layer (None = that layer is not budgeted; not for a self-sized spec)."""
        if isinstance(self.B, Mapping):
            value = self.B.get(layer_idx, self.B.get(str(layer_idx)))
        elif isinstance(self.B, Sequence) and not isinstance(self.B, str):
            if moe_ordinal >= len(self.B):
                raise VatError(f"budget list has {len(self.B)} entries but the target has more MoE layers")
            value = self.B[moe_ordinal]
        else:
            value = self.B
        if value is None:
            return None
        value = int(value)
        if value < 1:
            raise VatError(f"expert budget must be >= 1, got {value} for layer {layer_idx}")
        return value


def window_groups(
    positions: torch.Tensor, valid: torch.Tensor, spec: BudgetSpec
) -> tuple[torch.Tensor, int]:
    """Budget-window id of every token.

    Args:
        positions: (B, T) absolute positions of the tokens of this forward.
        valid: (B, T) bool, False for padding (padding is never budgeted nor counted).
        spec: the budget spec (window, offset, scope, start_position).

    Returns:
        ``(groups (B, T) int64, n_groups)``; -1 = not budgeted.
    """
    batch, _ = positions.shape
    budgeted = valid & (positions >= spec.start_position)  # (B, T)
    if spec.phase is not None:
        return _segment_windows(positions, budgeted, spec.window, spec.phase)
    if spec.window is None:
        local = torch.zeros_like(positions)
        n_local = 1
    else:
        local = torch.div(positions - spec.offset, spec.window, rounding_mode="floor")  # (B, T), may be -1
        lo = int(local[budgeted].min()) if budgeted.any() else 0
        local = local - lo
        n_local = int(local[budgeted].max()) + 1 if budgeted.any() else 1
    if spec.scope == "sequence":
        rows = torch.arange(batch, device=positions.device)[:, None]  # (B, 1)
        groups = rows * n_local + local
        n_groups = batch * n_local
    else:
        groups, n_groups = local, n_local
    groups = torch.where(budgeted, groups, torch.full_like(groups, -1))
    return groups, n_groups


def _segment_windows(
    positions: torch.Tensor, budgeted: torch.Tensor, window: int, phase: tuple[int, ...]
) -> tuple[torch.Tensor, int]:
    """Windows that restart at every run of budgeted positions, from a per-row phase (``BudgetSpec.phase``).

    Args:
        positions: (B, T) absolute positions, consecutive along each row's run of budgeted tokens.
        budgeted: (B, T) bool, the tokens to budget.
        window: W.
        phase: (B,) φ_r in ``[0, W)``.

    Returns:
        ``(groups (B, T) int64, n_groups)``; -1 = not budgeted; ids are dense (no empty window).
    """
    batch, length = positions.shape
    if len(phase) != batch:
        raise VatError(f"{len(phase)} budget window phases for a batch of {batch} rows")
    device = positions.device
    col = torch.arange(length, device=device).expand(batch, length)  # (B, T)
    before = torch.cat([torch.zeros_like(budgeted[:, :1]), budgeted[:, :-1]], dim=1)  # (B, T) previous is budgeted
    first = torch.where(budgeted & ~before, col, torch.full_like(col, -1)).cummax(dim=1).values  # (B, T) run start
    start = positions.gather(1, first.clamp_min(0))  # (B, T) position of the run's first token
    shift = torch.tensor(phase, dtype=torch.long, device=device)[:, None]  # (B, 1)
    j = torch.div(positions - start - shift, window, rounding_mode="floor") + 1  # (B, T): 0 = the leading window
    rows = torch.arange(batch, device=device)[:, None]
    key = (rows * length + first) * (length // window + 2) + j  # (B, T) one key per (row, run, window)
    groups = torch.full_like(positions, -1)
    if not bool(budgeted.any()):
        return groups, 1
    ids, dense = torch.unique(key[budgeted], return_inverse=True)
    groups[budgeted] = dense
    return groups, int(ids.numel())


def commitment_weights(
    positions: torch.Tensor, groups: torch.Tensor, n_groups: int, spec: AcceptMoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """AcceptMoE's per-token commitment weight α_t = p̂_{d_t}^β · N_{d_t}^{-1/2} and root flag.

    A token's draft depth d_t is its position minus the first position of its window: a chain or DFlash block is
    ``[root, d_1, ...]`` at consecutive positions (depth = index), a tree is laid out at ``n + depth``
    (:meth:`vat.eval.tree.DraftTree.block_depths`), so positions alone give depths in every layout. N_d = tokens of
    the window at depth d (1 for a chain).

    Args:
        positions: (N,) absolute positions.
        groups: (N,) window id, -1 = not budgeted.
        n_groups: number of windows.
        spec: p̂ and β.

    Returns:
        ``(alpha (N,) fp32, root (N,) bool)``; 0 / False for unbudgeted tokens.
    """
    member = groups >= 0  # (N,)
    g = groups.clamp_min(0)
    big = torch.iinfo(torch.long).max
    first = torch.full((max(n_groups, 1),), big, dtype=torch.long, device=positions.device)
    first.scatter_reduce_(0, g[member], positions[member].long(), reduce="amin")  # (G,) window start
    depth = torch.where(member, positions.long() - first[g], torch.zeros_like(g))  # (N,)
    max_depth = int(depth.max()) if depth.numel() else 0
    key = g * (max_depth + 1) + depth  # (N,) one id per (window, depth)
    n_at = torch.bincount(key[member], minlength=max(n_groups, 1) * (max_depth + 1))[key]  # (N,) N_{d_t}
    p_hat = spec.p_hat(max_depth).to(positions.device)[depth]  # (N,) float64
    alpha = p_hat.pow(spec.beta) * n_at.clamp_min(1).double().rsqrt()
    alpha = torch.where(member, alpha, torch.zeros_like(alpha)).float()
    return alpha, member & (depth == 0)


def effective_rank(demand: torch.Tensor) -> torch.Tensor:
    """AcceptMoE's self-size n_er = ⌈exp(−Σ_e q_e log q_e)⌉, q = demand⁺ / Z, per row; 0 for a row with no demand.

    Args:
        demand: (G, E) non-negative demand of the candidate experts (0 = not a candidate).

    Returns:
        (G,) int64.
    """
    u = demand.double().clamp_min(0.0)  # (G, E)
    total = u.sum(-1, keepdim=True)  # (G, 1)
    q = u / total.clamp_min(torch.finfo(torch.float64).tiny)
    entropy = -torch.where(q > 0, q * q.log(), torch.zeros_like(q)).sum(-1)  # (G,)
    n = torch.ceil(entropy.exp() - SIZE_TOLERANCE).long()
    return torch.where(total[:, 0] > 0, n, torch.zeros_like(n))


def budget_sets(
    scores: torch.Tensor,
    natural_ids: torch.Tensor,
    groups: torch.Tensor,
    n_groups: int,
    budget: int | None,
    *,
    token_weight: torch.Tensor | None = None,
    natural_only: bool = False,
    anchor: torch.Tensor | None = None,
    resident: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert set S of every window: its natural union if that fits, else the top experts by (weighted) demand.

    MoE-Spec (the defaults): demand s_e = Σ_t score_{t,e}; S = top-B(s). AcceptMoE: demand u_e = Σ_t α_t score_{t,e}
    1[e ∈ K_t] (``token_weight`` = α, ``natural_only``), the anchor tokens' natural experts A always in S, and
    |S| = |A| + n_er (``budget`` None: :func:`effective_rank` of the non-anchor demand) or ``budget`` (AcceptMoE-fix);
    |S| ≥ k always. Every window whose natural union has at most |S| experts gets exactly its union (the model is then
    bit-identical there).

    Args:
        scores: (N, E) fp32 routing scores (softmax probabilities or the model's sigmoid scores).
        natural_ids: (N, k) the tokens' natural top-k ids.
        groups: (N,) window id per token, -1 = not budgeted.
        n_groups: number of windows.
        budget: |S| (B), or None = self-sized.
        token_weight: (N,) demand weight per token (None = 1).
        natural_only: count a token's score only for its own natural top-k experts.
        anchor: (N,) bool, tokens whose natural experts are always kept (None = none).
        resident: (E,) bool experts resident on the GPU (AcceptMoE under offload): S is then pruned by
            :func:`prune_nonresident`. None = no pruning.

    Returns:
        (n_groups, E) bool: the allowed experts of each window.
    """
    num_experts, k = scores.shape[-1], natural_ids.shape[-1]
    member = groups >= 0  # (N,)
    g = groups.clamp_min(0)
    hits = torch.ones_like(natural_ids, dtype=torch.float32) * member[:, None]  # (N, k)
    natural = torch.zeros(scores.shape[0], num_experts + 1, dtype=torch.float32, device=scores.device)
    natural.scatter_(1, natural_ids, hits)  # (N, E + 1): 1 on each token's natural experts
    natural = natural[:, :num_experts]
    weight = member.float() if token_weight is None else token_weight.float() * member  # (N,)
    contrib = scores.float() * weight[:, None]  # (N, E)
    if natural_only:
        contrib = contrib * natural
    mass = torch.zeros(n_groups, num_experts, dtype=torch.float32, device=scores.device)
    mass.index_add_(0, g, contrib)  # (G, E): summed (weighted) demand per window
    used = torch.zeros(n_groups, num_experts, dtype=torch.float32, device=scores.device)
    used.index_add_(0, g, natural)
    union = used > 0  # (G, E)
    if anchor is None:
        kept = torch.zeros_like(union)
    else:
        held = torch.zeros(n_groups, num_experts, dtype=torch.float32, device=scores.device)
        held.index_add_(0, g, natural * anchor[:, None])
        kept = held > 0  # (G, E): A, always in S
    n_kept = kept.sum(-1)  # (G,)
    if budget is None:
        size = (n_kept + effective_rank(mass.masked_fill(kept, 0.0))).clamp(min=k, max=num_experts)  # (G,)
    else:
        size = n_kept.clamp(min=min(budget, num_experts))  # never below |A|: the anchor is always kept
    fits = union.sum(-1) <= size  # (G,)
    width = int(size.max()) if size.numel() else 0
    ranked = mass.masked_fill(kept, float("inf"))  # (G, E): the anchor first, then by demand
    top = torch.zeros_like(union)
    order = torch.topk(ranked, width, dim=-1).indices  # (G, width), best first
    take = torch.arange(width, device=scores.device)[None, :] < size[:, None]  # (G, width): the first |S| of each
    top.scatter_(1, order, take)
    sets = torch.where(fits[:, None], union, top)
    if resident is not None:
        sets = prune_nonresident(sets, mass, used, kept, resident, k)
    return sets


def prune_nonresident(
    sets: torch.Tensor, demand: torch.Tensor, assignments: torch.Tensor, anchor_sets: torch.Tensor,
    resident: torch.Tensor, k: int,
) -> torch.Tensor:
    r"""AcceptMoE's residency-aware pruning (its Eq. 6, offload only): drop S's least-demanded non-resident experts
    while the natural assignments they displace stay within what forming S already displaced.

    Per window: a(S) = Σ_{e ∉ S} v_e, the natural assignments S already reroutes (v_e = tokens whose natural top-k
    holds e); the candidates C = S \ H \ A (non-resident, not the root anchor's), ranked by demand u_e ascending
    (ties: lower id first); m* = max{m : Σ_{j ≤ m} v_{π(j)} ≤ a(S), |S| − m ≥ k}; the first m* candidates leave S.
    A window whose natural union fits its budget displaces nothing (a(S) = 0) and keeps S.

    Args:
        sets: (G, E) bool, S per window.
        demand: (G, E) u_e, the demand S was ranked by.
        assignments: (G, E) v_e, natural assignments per expert.
        anchor_sets: (G, E) bool, A (never pruned).
        resident: (E,) bool, H.
        k: the router's top-k (|S| never drops below it).

    Returns:
        (G, E) bool, the pruned S.
    """
    v = assignments.double()
    displaced = (v * ~sets).sum(-1, keepdim=True)  # (G, 1) a(S)
    candidate = sets & ~resident[None, :] & ~anchor_sets  # (G, E) C
    ranked = torch.where(candidate, demand.double(), torch.full_like(v, float("inf")))  # non-candidates last
    order = torch.sort(ranked, dim=-1, stable=True).indices  # (G, E) π: ascending demand, ties by id
    cum = v.gather(1, order).cumsum(-1)  # (G, E) Σ_{j ≤ m} v_π(j), m = 1..E
    m = torch.arange(1, v.shape[-1] + 1, device=sets.device)[None, :]  # (1, E)
    ok = candidate.gather(1, order) & (cum <= displaced) & (sets.sum(-1, keepdim=True) - m >= k)  # monotone in m
    drop = torch.zeros_like(sets)
    drop.scatter_(1, order, ok.cummin(-1).values)  # the longest prefix that satisfies every condition
    return sets & ~drop


def apply_budget(
    adapter: FamilyAdapter,
    router: torch.nn.Module,
    logits: torch.Tensor,
    natural: tuple[torch.Tensor, torch.Tensor],
    groups: torch.Tensor,
    n_groups: int,
    budget: int | None,
    policy: str,
    counts: dict[str, torch.Tensor] | None = None,
    *,
    token_weight: torch.Tensor | None = None,
    anchor: torch.Tensor | None = None,
    acceptmoe: AcceptMoESpec | None = None,
    moe_ordinal: int = 0,
    rank: str = "weights",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Budget one MoE layer's routing.

    ``substitute``: a token with an expert outside S reruns the model's own selection over S (k slots filled
    whenever S holds k experts). ``truncate`` (MoE-Spec's): its out-of-set slots are dropped (zero weight), the kept
    weights unchanged; a token with no natural expert in S gets no expert output. ``truncate_cover``: the kept
    weights are rescaled to the natural total, and a token with *no* natural expert in S is substituted instead.
    ``acceptmoe``: S from commitment-weighted demand (:func:`budget_sets` with ``token_weight`` / ``anchor``), then
    substitution.

    Args:
        adapter: the family's routing rule.
        router: the router module.
        logits: (N, E) router logits.
        natural: the router's own ``(topk_weights (N, k), topk_ids (N, k))``.
        groups: (N,) window id per token, -1 = leave natural.
        n_groups: number of windows.
        budget: B for this layer; None = self-sized (``acceptmoe`` only).
        policy: ``substitute``, ``truncate``, ``truncate_cover`` or ``acceptmoe``.
        counts: if given, receives ``"uncovered"``: a 0-d int64 tensor, the budgeted tokens none of whose natural
            experts is in S (no host sync: it stays on the device); and, unless nothing is restricted (B >= E),
            ``"allowed"``: (N, E) bool, each token's window set S (all True for unbudgeted tokens).
        token_weight: (N,) AcceptMoE's α per token (:func:`commitment_weights`); ``acceptmoe`` only.
        anchor: (N,) bool, the root token of each window; ``acceptmoe`` only.
        acceptmoe: its demand/anchor switches (default :class:`AcceptMoESpec`), and its residency under offload.
        moe_ordinal: this layer's MoE ordinal (which layer's resident experts the residency pruning reads).
        rank: which scores the demand sums (:data:`RANKS`, :meth:`FamilyAdapter.scores`).

    Returns:
        ``(topk_weights (N, k), topk_ids (N, k))`` with at most |S| distinct ids per window; dropped slots hold
        the sentinel ``num_experts`` with weight 0. Tokens whose natural top-k lies inside S keep their natural
        weights and ids bit for bit.
    """
    weights, ids = natural
    num_experts = logits.shape[-1]
    if budget is None and policy != "acceptmoe":
        raise VatError(f"a self-sized expert set needs policy acceptmoe, not `{policy}`")
    if budget is not None and budget >= num_experts:
        if counts is not None:
            counts["uncovered"] = torch.zeros((), dtype=torch.int64, device=ids.device)
        return weights, ids
    scores = adapter.scores(router, logits, rank)  # (N, E)
    if policy == "acceptmoe":
        acceptmoe = acceptmoe or AcceptMoESpec()
        allowed_sets = budget_sets(
            scores, ids, groups, n_groups, budget, token_weight=token_weight,
            natural_only=acceptmoe.demand == "natural", anchor=anchor if acceptmoe.anchor else None,
            resident=acceptmoe.resident_mask(moe_ordinal, num_experts, logits.device),
        )  # (G, E)
    else:
        allowed_sets = budget_sets(scores, ids, groups, n_groups, budget)  # (G, E)
    member = groups >= 0
    allowed = allowed_sets[groups.clamp_min(0)] | ~member[:, None]  # (N, E); unbudgeted tokens allow all
    if counts is not None:
        counts["allowed"] = allowed  # each token's set S, read by Window Pool training (vat/window_pool)
    in_set = torch.cat([allowed, torch.zeros_like(allowed[:, :1])], dim=1).gather(1, ids)  # (N, k)
    inside = in_set.all(dim=1)  # (N,) natural top-k already inside S
    uncovered = ~in_set.any(dim=1)  # (N,) no natural expert in S (never true for unbudgeted tokens)
    if counts is not None:
        counts["uncovered"] = uncovered.sum()
    if bool(inside.all()):
        return weights, ids
    if policy == "truncate":  # MoE-Spec: out-of-set experts get zero weight, nothing rescaled or substituted
        new_w = torch.where(in_set, weights, torch.zeros_like(weights))
        new_ids = torch.where(in_set, ids, torch.full_like(ids, num_experts))
    else:
        sub_w, sub_ids = adapter.select(router, logits, allowed)
        sub_w = sub_w.to(weights.dtype)
        if policy != "truncate_cover":
            new_w, new_ids = sub_w, sub_ids
        else:
            new_w, new_ids = _truncate(weights, ids, in_set, num_experts)
            new_w = torch.where(uncovered[:, None], sub_w, new_w)  # coverage: nothing left to truncate to
            new_ids = torch.where(uncovered[:, None], sub_ids, new_ids)
    keep_natural = inside[:, None]
    return torch.where(keep_natural, weights, new_w), torch.where(keep_natural, ids, new_ids)


def _truncate(
    weights: torch.Tensor, ids: torch.Tensor, in_set: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the out-of-set slots (sentinel id, weight 0) and rescale the kept weights to the natural total.

    Args:
        weights: (N, k) natural weights.
        ids: (N, k) natural ids.
        in_set: (N, k) bool, slot's expert is in S.
        num_experts: E (the sentinel).

    Returns:
        ``(topk_weights (N, k), topk_ids (N, k))``; a row with no kept slot is all sentinel, weight 0.
    """
    kept = weights * in_set  # (N, k)
    total = weights.sum(dim=1, keepdim=True)
    kept_total = kept.sum(dim=1, keepdim=True)
    scale = torch.where(kept_total > 0, total / kept_total.clamp_min(torch.finfo(kept.dtype).tiny), 0.0)
    new_ids = torch.where(in_set, ids, torch.full_like(ids, num_experts))
    return (kept * scale).to(weights.dtype), new_ids
