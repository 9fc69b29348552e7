"""AcceptMoE (policy ``acceptmoe``, docs/verification_policies.md): commitment weights from block depths, the self-sized eligible
set against a per-layer Python reference written from the paper's formula, its effective-rank sizing on hand cases,
the reduction to MoE-Spec (α ≡ 1, |S| = B, score demand, no anchor) through the real router hook, and the anchor."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_eagle3_draft
from tiny_models import FAMILIES, tiny_model

from vat.errors import VatError
from vat.eval.tree import DraftTree
from vat.target import BudgetSpec, load_target, window_union
from vat.target.budget import AcceptMoESpec, budget_sets, commitment_weights, effective_rank

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- commitment weights ------------------------------------------------------------------------------------------


def test_commitment_weights_on_a_chain_and_a_tree():
    spec = AcceptMoESpec(commitment=(0.64, 0.36))
    # a chain of 4 at positions 10..13 (root + 3 drafts): depth = index, N_d = 1; depth 3 reuses p̂_2
    alpha, root = commitment_weights(torch.arange(10, 14), torch.zeros(4, dtype=torch.long), 1, spec)
    assert alpha.tolist() == pytest.approx([1.0, 0.8, 0.6, 0.6])
    assert root.tolist() == [True, False, False, False]
    # a real tree layout: root, two children, three grandchildren, laid out at n + depth
    tree = DraftTree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 0, 1], depths=[1, 1, 2, 2, 2], scores=[0.0] * 5)
    positions = 20 + tree.block_depths()  # (6,)
    alpha, root = commitment_weights(positions, torch.zeros(6, dtype=torch.long), 1, spec)
    want = [1.0] + [0.8 / math.sqrt(2)] * 2 + [0.6 / math.sqrt(3)] * 3
    assert alpha.tolist() == pytest.approx(want)
    assert root.tolist() == [True] + [False] * 5


def test_commitment_weights_per_window_and_default_prior():
    # two windows of 3 tiled over positions 4..9 (the KL tiling), plus an unbudgeted prompt position
    positions = torch.tensor([3, 4, 5, 6, 7, 8, 9])
    groups = torch.tensor([-1, 0, 0, 0, 1, 1, 1])
    alpha, root = commitment_weights(positions, groups, 2, AcceptMoESpec())  # p̂_d = 0.8^d
    want = [0.0, 1.0, 0.8**0.5, 0.8, 1.0, 0.8**0.5, 0.8]
    assert alpha.tolist() == pytest.approx(want)
    assert root.tolist() == [False, True, False, False, True, False, False]


def test_bad_acceptmoe_settings_are_refused_in_one_line():
    with pytest.raises(VatError, match="commitment probabilities"):
        AcceptMoESpec(commitment=(0.5, 1.5))
    with pytest.raises(VatError, match="needs policy acceptmoe"):
        BudgetSpec(B="auto", policy="substitute")
    assert BudgetSpec(B="auto", policy="acceptmoe").self_sized


# ---- self-sizing -------------------------------------------------------------------------------------------------


def test_effective_rank_hand_cases():
    demand = torch.tensor([
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0],  # uniform over 3: exp(H) = 3 exactly -> 3 (not 4 from rounding)
        [2.0, 1.0, 1.0, 0.0, 0.0, 0.0],  # q = (1/2, 1/4, 1/4): exp(H) = 2^1.5 = 2.83 -> 3
        [9.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # q = (0.9, 0.1): exp(H) = 1.38 -> 2
        [5.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # one expert -> 1
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # no demand -> 0
        [1.0] * 6,  # uniform over 6 -> 6
    ])
    assert effective_rank(demand).tolist() == [3, 3, 2, 1, 0, 6]


def _hand_window(num_experts: int, routes: list[dict[int, float]]):
    """One window of len(routes) tokens: token t's natural experts and scores are ``routes[t]`` ({expert: score})."""
    k = len(routes[0])
    scores = torch.zeros(len(routes), num_experts)
    ids = torch.zeros(len(routes), k, dtype=torch.long)
    for t, route in enumerate(routes):
        for slot, (e, r) in enumerate(route.items()):
            scores[t, e], ids[t, slot] = r, e
    return scores, ids, torch.zeros(len(routes), dtype=torch.long)


def test_self_sizing_hand_case():
    """One chain window, E = 8, k = 2: the root routes to {0, 1}; drafts at depths 1-3 route to {2, 3}, {2, 4}, {2, 5}
    with scores (0.9, 0.1), (0.85, 0.15), (0.8, 0.2).

    p̂ = 1 everywhere (α = 1): u over R = {2..7} is (2.55, 0.1, 0.15, 0.2, 0, 0), exp(H(q)) = 1.79 -> n_er = 2, so
    S = A ∪ {2, 5} = {0, 1, 2, 5}: 4 of the union's 6 experts. With depth 3 never committed (p̂_3 = 0, α = 0) its
    expert 5 has no demand: u = (1.75, 0.1, 0.15), exp(H) = 1.59 -> 2, S = {0, 1, 2, 4}.
    """
    num_experts = 8
    scores, ids, groups = _hand_window(num_experts, [{0: 0.5, 1: 0.5}, {2: 0.9, 3: 0.1}, {2: 0.85, 4: 0.15},
                                                     {2: 0.8, 5: 0.2}])

    def eligible(commitment):
        alpha, root = commitment_weights(torch.arange(4), groups, 1, AcceptMoESpec(commitment=commitment))
        sets = budget_sets(scores, ids, groups, 1, None, token_weight=alpha, natural_only=True, anchor=root)
        return set(sets[0].nonzero().flatten().tolist())

    assert eligible((1.0, 1.0, 1.0)) == {0, 1, 2, 5}
    assert eligible((1.0, 1.0, 0.0)) == {0, 1, 2, 4}
    # a flatter demand sizes itself larger: experts 3 and 4 as likely as 2 -> n_er = 3, the whole union fits
    scores[1, 2], scores[1, 3], ids[1] = 0.5, 0.5, torch.tensor([2, 3])
    scores[2, 2], scores[2, 4] = 0.5, 0.5
    scores[3, 2], scores[3, 5] = 0.0, 0.0
    scores[3, 3], ids[3] = 0.5, torch.tensor([3, 4])
    scores[3, 4] = 0.5
    # u = (1.0, 1.0, 1.0) over {2, 3, 4}: n_er = 3, union {0..4} has 5 = |A| + 3 experts -> S = union
    assert eligible((1.0, 1.0, 1.0)) == {0, 1, 2, 3, 4}


# ---- against a per-layer reference written from the formula -----------------------------------------------------


def _reference_sets(scores, ids, positions, groups, p_hat, beta, size):
    """S per window with Python loops: α_t = p̂_{d_t}^β N_{d_t}^{-1/2}, u_e = Σ_t α_t r_{t,e} 1[e ∈ K_t],
    A = the root's natural top-k, R = the rest ranked by u, n_er = ⌈exp(H(q))⌉ (or |S| = size), |S| ≥ k; the union
    when it fits."""
    n, num_experts, k = len(scores), len(scores[0]), len(ids[0])
    windows: dict[int, list[int]] = {}
    for t in range(n):
        if groups[t] >= 0:
            windows.setdefault(groups[t], []).append(t)
    out = {}
    for g, tokens in windows.items():
        start = min(positions[t] for t in tokens)
        depth = {t: positions[t] - start for t in tokens}
        count = {d: sum(1 for t in tokens if depth[t] == d) for d in depth.values()}
        u = [0.0] * num_experts
        for t in tokens:
            d = depth[t]
            p = 1.0 if d == 0 else p_hat[min(d, len(p_hat)) - 1]
            alpha = p**beta / math.sqrt(count[d])
            for e in ids[t]:
                u[e] += alpha * scores[t][e]
        anchor = {e for t in tokens if depth[t] == 0 for e in ids[t]}
        rest = [e for e in range(num_experts) if e not in anchor]
        if size is None:
            z = sum(max(u[e], 0.0) for e in rest)
            entropy = -sum((u[e] / z) * math.log(u[e] / z) for e in rest if u[e] > 0) if z > 0 else 0.0
            n_er = math.ceil(math.exp(entropy) - 1e-6) if z > 0 else 0
            total = max(len(anchor) + n_er, k)
        else:
            total = max(size, len(anchor))
        union = {e for t in tokens for e in ids[t]}
        if len(union) <= total:
            out[g] = union
            continue
        ranked = sorted(rest, key=lambda e: -u[e])
        out[g] = anchor | set(ranked[: total - len(anchor)])
    return out


@pytest.mark.parametrize("size", [None, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_acceptmoe_sets_match_the_reference(seed, size):
    gen = torch.Generator().manual_seed(seed)
    num_experts, k = 16, 4
    logits = torch.randn(26, num_experts, generator=gen) * 2.0
    scores = torch.softmax(logits, dim=-1)  # (N, E)
    ids = scores.topk(k, dim=-1).indices  # (N, k)
    # window 0: a tree (root, 3 at depth 1, 4 at depth 2, 2 at depth 3); window 1: a chain of 8; window 2: a tree of
    # 7; token 0 is an unbudgeted prompt position
    tree0 = [0, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    tree2 = [0, 1, 1, 2, 2, 2, 3]
    positions = torch.tensor([4] + [50 + d for d in tree0] + list(range(60, 68)) + [70 + d for d in tree2])
    groups = torch.tensor([-1] + [0] * 10 + [1] * 8 + [2] * 7)
    assert positions.numel() == 26
    p_hat = (0.7, 0.45, 0.3)
    spec = AcceptMoESpec(commitment=p_hat)
    alpha, root = commitment_weights(positions, groups, 3, spec)
    got = budget_sets(scores, ids, groups, 3, size, token_weight=alpha, natural_only=True, anchor=root)
    want = _reference_sets(scores.tolist(), ids.tolist(), positions.tolist(), groups.tolist(), p_hat, 0.5, size)
    for g in range(3):
        assert set(got[g].nonzero().flatten().tolist()) == want[g], (g, size)
    if size is None:  # the windows really are cut (the reference is not only the union-fits branch)
        unions = [len({e for t in range(26) if groups[t] == g for e in ids[t].tolist()}) for g in range(3)]
        assert any(len(want[g]) < unions[g] for g in range(3))


# ---- the reduction to MoE-Spec, through the real router hook -----------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_all_ones_commitment_at_size_b_equals_moe_spec(family):
    """α ≡ 1 (p̂ = 1 on chain windows, N_d = 1), |S| forced to B, demand over every expert's score and no anchor:
    MoE-Spec's selection, so the whole budgeted forward (logits, executed experts) equals ``substitute`` at B. The
    windows are cut (natural union > B), so this is the top-B path, not the union-fits or B >= E exits."""
    model = tiny_model(family, num_experts=8, top_k=2)
    target = load_target(model, device="cpu")
    try:
        ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(3))
        budget, window = 3, 6
        natural = target.forward(ids, output_aux=False)
        groups = torch.arange(12).div(window, rounding_mode="floor").expand(2, -1) + torch.tensor([[0], [2]])
        unions = window_union(natural.topk_ids, groups, 4, target.num_experts)  # (L', 4)
        assert int(unions.max()) > budget
        moe_spec = BudgetSpec(B=budget, policy="substitute", window=window)
        ones = AcceptMoESpec(commitment=(1.0,), demand="score", anchor=False)
        accept = BudgetSpec(B=budget, policy="acceptmoe", window=window, acceptmoe=ones)
        a = target.forward(ids, budget=moe_spec, output_aux=False)
        b = target.forward(ids, budget=accept, output_aux=False)
        assert torch.equal(a.topk_ids, b.topk_ids)
        assert torch.equal(a.logits, b.logits)
        assert not torch.equal(a.logits, natural.logits)  # the budget really changed the model
        # the paper's own demand and anchor pick other sets at the same B (why the switches exist)
        paper = BudgetSpec(B=budget, policy="acceptmoe", window=window, acceptmoe=AcceptMoESpec(commitment=(1.0,)))
        c = target.forward(ids, budget=paper, output_aux=False)
        assert int(window_union(c.topk_ids, groups, 4, target.num_experts).max()) <= max(budget, target.top_k)
    finally:
        target.close()


def test_self_sized_acceptmoe_keeps_the_root_natural_and_sizes_each_window():
    model = tiny_model("olmoe", num_experts=16, top_k=4, seed=1)
    target = load_target(model, device="cpu")
    try:
        ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(5))
        natural = target.forward(ids, output_aux=False)
        spec = BudgetSpec(B="auto", policy="acceptmoe", window=8, acceptmoe=AcceptMoESpec(commitment=(0.6, 0.4)))
        out = target.forward(ids, budget=spec, output_aux=False)
        for root in (0, 8):  # each window's root keeps its natural experts (A is always eligible)
            assert torch.equal(out.topk_ids[:, 0, root], natural.topk_ids[:, 0, root])
        groups = out.window_groups
        nat_u = window_union(natural.topk_ids, groups, 2, target.num_experts)  # (L', 2)
        got_u = window_union(out.topk_ids, groups, 2, target.num_experts)
        assert bool((got_u <= nat_u).all()) and bool((got_u >= target.top_k).all())
        assert bool((got_u < nat_u).any())  # self-sizing cut something
    finally:
        target.close()


def test_tree_verification_weighs_tokens_by_their_tree_depth(monkeypatch):
    """Through the engine: every tree verification forward under ``acceptmoe`` gets α from the tree's own depths
    (N_d > 1 at some depth), and the decode runs to its length with a cut union."""
    import vat.target.model as model_module
    from vat.eval.engine import SpeculativeEngine
    from vat.eval.policies.acceptmoe import AcceptMoEBudget
    from vat.eval.tree import TreeSpec

    model = tiny_model("olmoe", seed=2)
    target = load_target(model, device="cpu")
    seen = []
    real = model_module.commitment_weights

    def recording(positions, groups, n_groups, spec):
        alpha, root = real(positions, groups, n_groups, spec)
        seen.append((positions.clone(), alpha.clone(), root.clone()))
        return alpha, root

    monkeypatch.setattr(model_module, "commitment_weights", recording)
    try:
        draft = make_eagle3_draft(model, target, rigged=True)
        spec = AcceptMoESpec(commitment=(0.5, 0.25))
        engine = SpeculativeEngine(target, draft, tree=TreeSpec(3, 3, 8), budget="auto", policy="acceptmoe",
                                   policies=[AcceptMoEBudget(spec)], max_new_tokens=16)
        gen = engine.generate(torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(0)).tolist())
    finally:
        target.close()
    assert len(gen.token_ids) == 16 and len(seen) == len(gen.rounds)
    wide = 0
    for positions, alpha, root in seen:
        depth = positions - positions.min()
        counts = torch.bincount(depth)
        p_hat = torch.tensor([1.0, 0.5, 0.25, 0.25])[depth.clamp_max(3)]
        assert torch.allclose(alpha, (p_hat.sqrt() / counts[depth].float().sqrt()).float())
        assert root.tolist() == (depth == 0).tolist() and int(root.sum()) == 1
        wide += int(counts.max()) > 1
    assert wide > 0


# ---- residency pruning under offload (the paper's Eq. 6) ---------------------------------------------------------


def test_residency_pruning_hand_case():
    """The self-sizing hand case's window (E = 8, k = 2; the root routes to {0, 1}; depths 1-3 to {2, 3}, {2, 4},
    {2, 5}), p̂ = 1. Natural assignments v: 2 -> 3, every other union expert -> 1.

    Self-sized S = {0, 1, 2, 5} displaces a(S) = v_3 + v_4 = 2. With H = {0, 1, 2} the only non-resident non-anchor
    expert is 5 (v = 1 <= 2, |S| - 1 = 3 >= k): it goes, S = {0, 1, 2}. With 5 resident nothing is pruned.
    AcceptMoE-fix at |S| = 5: S = {0, 1, 2, 4, 5} (u_4 = 0.15 < u_5 = 0.2 < u_2 = 2.55), a(S) = v_3 = 1. With
    H = {0, 1}, C = {4, 5, 2} by demand; the cumulative v is 1, 2, 5: only 4 fits a(S) = 1, so S = {0, 1, 2, 5}.
    """
    num_experts = 8
    scores, ids, groups = _hand_window(num_experts, [{0: 0.5, 1: 0.5}, {2: 0.9, 3: 0.1}, {2: 0.85, 4: 0.15},
                                                     {2: 0.8, 5: 0.2}])
    alpha, root = commitment_weights(torch.arange(4), groups, 1, AcceptMoESpec(commitment=(1.0,)))

    def eligible(size, resident):
        mask = None if resident is None else torch.isin(torch.arange(num_experts), torch.tensor(resident))
        sets = budget_sets(scores, ids, groups, 1, size, token_weight=alpha, natural_only=True, anchor=root,
                           resident=mask)
        return set(sets[0].nonzero().flatten().tolist())

    assert eligible(None, None) == {0, 1, 2, 5}
    assert eligible(None, [0, 1, 2]) == {0, 1, 2}
    assert eligible(None, [0, 1, 2, 5]) == {0, 1, 2, 5}
    assert eligible(5, None) == {0, 1, 2, 4, 5}
    assert eligible(5, [0, 1]) == {0, 1, 2, 5}
    # the anchor is never pruned, even when nothing is resident; k bounds |S| from below
    assert eligible(None, []) >= {0, 1} and len(eligible(None, [])) >= 2


def _reference_pruned(sets, scores, ids, positions, groups, p_hat, beta, resident, k):
    """Eq. 6 with Python loops on top of :func:`_reference_sets`: a(S) = natural assignments outside S; candidates
    S \\ H \\ A by demand ascending (ties by id); drop the longest prefix whose v sum stays within a(S) and leaves
    |S| >= k."""
    out = {}
    for g, s in sets.items():
        tokens = [t for t in range(len(scores)) if groups[t] == g]
        start = min(positions[t] for t in tokens)
        depth = {t: positions[t] - start for t in tokens}
        count = {d: sum(1 for t in tokens if depth[t] == d) for d in depth.values()}
        u = [0.0] * len(scores[0])
        v = [0] * len(scores[0])
        for t in tokens:
            d = depth[t]
            p = 1.0 if d == 0 else p_hat[min(d, len(p_hat)) - 1]
            for e in ids[t]:
                u[e] += p**beta / math.sqrt(count[d]) * scores[t][e]
                v[e] += 1
        anchor = {e for t in tokens if depth[t] == 0 for e in ids[t]}
        displaced = sum(v[e] for e in range(len(v)) if e not in s)
        candidates = sorted((e for e in s if e not in resident and e not in anchor), key=lambda e: (u[e], e))
        m, total = 0, 0
        while m < len(candidates) and total + v[candidates[m]] <= displaced and len(s) - (m + 1) >= k:
            total += v[candidates[m]]
            m += 1
        out[g] = set(s) - set(candidates[:m])
    return out


@pytest.mark.parametrize("size", [None, 5, 7])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_residency_pruning_matches_the_reference(seed, size):
    gen = torch.Generator().manual_seed(seed)
    num_experts, k = 16, 4
    scores = torch.softmax(torch.randn(25, num_experts, generator=gen) * 2.0, dim=-1)  # (N, E)
    ids = scores.topk(k, dim=-1).indices  # (N, k)
    tree = [0, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    positions = torch.tensor([4] + [50 + d for d in tree] + list(range(60, 68)) + [70 + d for d in tree[:6]])
    groups = torch.tensor([-1] + [0] * 10 + [1] * 8 + [2] * 6)
    p_hat = (0.7, 0.45, 0.3)
    alpha, root = commitment_weights(positions, groups, 3, AcceptMoESpec(commitment=p_hat))
    resident = torch.randperm(num_experts, generator=gen)[:6]
    mask = torch.isin(torch.arange(num_experts), resident)
    got = budget_sets(scores, ids, groups, 3, size, token_weight=alpha, natural_only=True, anchor=root, resident=mask)
    args = (scores.tolist(), ids.tolist(), positions.tolist(), groups.tolist(), p_hat, 0.5)
    unpruned = _reference_sets(*args, size)
    want = _reference_pruned(unpruned, *args, set(resident.tolist()), k)
    for g in range(3):
        assert set(got[g].nonzero().flatten().tolist()) == want[g], (g, size)
    assert any(want[g] != unpruned[g] for g in range(3)) or seed > 0  # seed 0 prunes something (not only no-ops)


def test_live_residency_is_what_the_offload_replay_holds(monkeypatch):
    """Through the engine: at every verification forward of a chain decode under ``acceptmoe`` + residency, the
    resident set the router hook reads is the one an offline replay of the decode's recorded trace (the offload
    model's caches) holds before that forward; pruning happens once the caches are full."""
    from vat.eval.engine import SpeculativeEngine
    from vat.eval.offload import ResidencyCache
    from vat.eval.policies.acceptmoe import AcceptMoEBudget, LiveResidency

    model = tiny_model("olmoe", num_experts=16, top_k=2, seed=2)
    target = load_target(model, device="cpu")
    reads: list[tuple[int, frozenset | None]] = []
    real = LiveResidency.resident_experts

    def recording(self, moe_ordinal):
        got = real(self, moe_ordinal)
        reads.append((moe_ordinal, None if got is None else frozenset(got)))
        return got

    monkeypatch.setattr(LiveResidency, "resident_experts", recording)
    capacity = 6
    try:
        draft = make_eagle3_draft(model, target, rigged=True)
        hook = AcceptMoEBudget(AcceptMoESpec(commitment=(0.9, 0.8)), LiveResidency(capacity, "lru"))
        engine = SpeculativeEngine(target, draft, steps=5, budget="auto", policy="acceptmoe", policies=[hook],
                                   max_new_tokens=40, record_experts=True)
        prompt = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(0)).tolist()
        engine.generate(prompt[:4])  # a warm-up, forgotten by start_pass
        engine.start_pass()
        reads.clear()
        gen = engine.generate(prompt)
    finally:
        target.close()
    layers = len(gen.rounds[0].expert_sets)
    caches = [ResidencyCache(capacity, "lru") for _ in range(layers)]
    want = []
    for r in gen.rounds:  # the replay: the state before each forward, per layer, then that forward's sets
        for layer, cache in enumerate(caches):
            full = len(cache.last_use) >= capacity
            want.append((layer, frozenset(cache.resident) if full else None))
        for cache, experts in zip(caches, r.expert_sets, strict=True):
            cache.access(experts)
    assert reads == want
    assert sum(s is not None for _, s in reads) > layers  # the caches filled and were read while full


def test_residency_settings_are_refused_in_one_line():
    from vat.eval.config import eval_config
    from vat.eval.policies.registry import picked

    with pytest.raises(VatError, match=r"--acceptmoe-residency 8 prunes against .* add it to --offload \(got none\)"):
        picked(eval_config(policy="acceptmoe", acceptmoe_residency=8, cost_model="h200"), None)
    with pytest.raises(VatError, match=r"add it to --offload \(got 4,6\)"):
        picked(eval_config(policy="acceptmoe", acceptmoe_residency=8, offload="4,6", cost_model="h200"), None)
    with pytest.raises(VatError, match=r"--acceptmoe-residency is AcceptMoE's residency pruning: add --policy "
                                       r"acceptmoe"):
        picked(eval_config(acceptmoe_residency=8, offload="8", cost_model="h200"), None)
    assert picked(eval_config(policy="acceptmoe", acceptmoe_residency=8, offload="4,8", cost_model="h200"), None)
