"""Simulated verification (vat/verify.py) against brute-force Python references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vat.verify import (
    expected_accept,
    first_rejection,
    gather_block_targets,
    gather_ttt_targets,
    greedy_accept,
    kstar_distribution,
    onpolicy_censor,
    sampled_accept,
    simulate_verification,
    survival,
    target_dist,
    target_to_draft_index,
)

FEW = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------------------------------------------- brute force


def bf_chain(m: list[int], valid: list[bool]) -> tuple[int, list[int]]:
    """First rejection (1-indexed, K+1 if none) and survival; a chain stops at its first invalid position."""
    K = len(m)
    kstar = K + 1
    for k in range(K):
        if not (valid[k] and m[k]):
            kstar = k + 1
            break
    v = [1 if k + 1 < kstar else 0 for k in range(K)]
    return kstar, v


def bf_metrics(m: list[list[int]], valid: list[list[bool]]):
    """τ sums, acc_k and cond_acc_k sums/counts over a list of anchors."""
    K = len(m[0])
    tau_sum, anchors = 0.0, 0
    acc_s, acc_c, cond_s, cond_c = [0.0] * K, [0.0] * K, [0.0] * K, [0.0] * K
    for mi, vi in zip(m, valid):
        _, v = bf_chain(mi, vi)
        if vi[0]:
            anchors += 1
            tau_sum += 1 + sum(v)
        for k in range(K):
            if not vi[k]:
                continue
            acc_s[k] += mi[k]
            acc_c[k] += 1
            prefix = all(vi[j] and mi[j] for j in range(k))
            if prefix:
                cond_c[k] += 1
                cond_s[k] += mi[k]
    return tau_sum, anchors, acc_s, acc_c, cond_s, cond_c


def logits_with_argmax(argmax: torch.Tensor, V: int, gen: torch.Generator) -> torch.Tensor:
    """Random logits of shape argmax.shape + (V,) whose argmax is ``argmax`` (unique max)."""
    x = torch.randn(*argmax.shape, V, generator=gen)
    x.scatter_(-1, argmax.unsqueeze(-1), 10.0)
    return x


# ---------------------------------------------------------------------------------------------------- chain rule


CASES = {
    "no_rejection": ([1, 1, 1, 1], [True] * 4, 5, [1, 1, 1, 1]),
    "reject_step1": ([0, 1, 1, 1], [True] * 4, 1, [0, 0, 0, 0]),
    "reject_last": ([1, 1, 1, 0], [True] * 4, 4, [1, 1, 1, 0]),
    "reject_middle": ([1, 0, 1, 1], [True] * 4, 2, [1, 0, 0, 0]),
    "masked_tail": ([1, 1, 1, 1], [True, True, False, False], 3, [1, 1, 0, 0]),
    "masked_gap": ([1, 1, 1, 1], [True, False, True, True], 2, [1, 0, 0, 0]),
    "masked_first": ([1, 1, 1, 1], [False, True, True, True], 1, [0, 0, 0, 0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kstar_and_survival_cases(name):
    m, valid, kstar, v = CASES[name]
    assert bf_chain(m, valid) == (kstar, v)
    mt, vt = torch.tensor([m], dtype=torch.float32), torch.tensor([valid])
    assert first_rejection(mt, vt).tolist() == [kstar]
    assert survival(mt, vt).tolist() == [[float(x) for x in v]]
    probs = kstar_distribution(mt, vt)
    assert probs.shape == (1, 5) and probs[0, kstar - 1] == 1 and probs.sum() == 1


@FEW
@given(
    st.lists(
        st.tuples(st.lists(st.booleans(), min_size=5, max_size=5), st.lists(st.booleans(), min_size=5, max_size=5)),
        min_size=1,
        max_size=12,
    )
)
def test_chain_matches_brute_force(rows):
    m = [[int(x) for x in r[0]] for r in rows]
    valid = [list(r[1]) for r in rows]
    mt, vt = torch.tensor(m, dtype=torch.float32), torch.tensor(valid)
    ks = first_rejection(mt, vt)
    sv = survival(mt, vt)
    for i in range(len(rows)):
        kstar, v = bf_chain(m[i], valid[i])
        assert ks[i].item() == kstar
        assert sv[i].tolist() == [float(x) for x in v]
        # survival and k* agree: v_k = 1 iff k < k*
        assert int(sv[i].sum().item()) == kstar - 1


@FEW
@given(st.lists(st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4), min_size=1, max_size=6))
def test_kstar_distribution_is_a_distribution(alphas):
    a = torch.tensor(alphas, dtype=torch.float32)
    probs = kstar_distribution(a)
    assert torch.allclose(probs.sum(-1), torch.ones(len(alphas)), atol=1e-6)
    # E[#accepted] = Σ_j (j-1) P(k* = j) = Σ_k v_k (τ_sim - 1)
    j = torch.arange(1, 6, dtype=torch.float32)
    assert torch.allclose((probs * (j - 1)).sum(-1), survival(a).sum(-1), atol=1e-5)


# ---------------------------------------------------------------------------------------------------- simulate_verification


@pytest.mark.parametrize("shape", [(3, 5), (2, 4, 6)])
def test_simulate_greedy_metrics_brute_force(shape):
    gen = torch.Generator().manual_seed(1)
    K, Vd = 5, 7
    lead = tuple(shape)  # anchor dims
    n_anchor = int(torch.tensor(lead).prod())
    tgt = torch.randint(-1, Vd, lead + (K,), generator=gen)  # draft id of the target argmax (-1 = outside)
    drf = torch.where(
        torch.rand(lead + (K,), generator=gen) < 0.7, tgt.clamp_min(0), torch.randint(0, Vd, lead + (K,), generator=gen)
    )
    draft_logits = logits_with_argmax(drf, Vd, gen)
    valid = torch.rand(lead + (K,), generator=gen) < 0.85
    from vat.verify import TargetDist

    td = TargetDist(
        argmax=tgt, argmax_draft=tgt, probs=torch.full(lead + (K, Vd), 1.0 / Vd), mass=torch.ones(lead + (K,))
    )
    res = simulate_verification(draft_logits, td, valid)

    m_flat = ((drf == tgt) & (tgt >= 0)).reshape(n_anchor, K).int().tolist()
    v_flat = valid.reshape(n_anchor, K).tolist()
    tau_sum, anchors, acc_s, acc_c, cond_s, cond_c = bf_metrics(m_flat, v_flat)
    assert res.tau_sum.item() == pytest.approx(tau_sum)
    assert res.anchor_count.item() == anchors
    assert res.acc_sum.tolist() == pytest.approx(acc_s)
    assert res.acc_count.tolist() == pytest.approx(acc_c)
    assert res.cond_acc_sum.tolist() == pytest.approx(cond_s)
    assert res.cond_acc_count.tolist() == pytest.approx(cond_c)
    for i, (mi, vi) in enumerate(zip(m_flat, v_flat)):
        kstar, v = bf_chain(mi, vi)
        assert res.kstar.reshape(-1)[i].item() == kstar
        assert res.survival.reshape(n_anchor, K)[i].tolist() == [float(x) for x in v]
    assert res.tau_sim == pytest.approx(tau_sum / max(anchors, 1))
    assert res.accept.shape == lead + (K,) and res.kstar_probs.shape == lead + (K + 1,)


def test_greedy_compares_with_target_argmax_not_data_token():
    # the target's argmax is a token outside the draft vocab -> never accepted, whatever the data says
    gen = torch.Generator().manual_seed(0)
    V, d2t = 10, torch.tensor([0, 2, 4, 6, 8])
    p_argmax = torch.tensor([[2, 3, 8]])  # (1, K=3) target ids; 3 is outside the draft vocab
    target_logits = logits_with_argmax(p_argmax, V, gen)
    draft_logits = logits_with_argmax(torch.tensor([[1, 1, 4]]), 5, gen)  # draft ids -> targets 2, 2, 8
    res = simulate_verification(draft_logits, target_logits, acceptance="greedy", draft_to_target=d2t)
    assert res.accept.tolist() == [[1.0, 0.0, 1.0]]
    assert res.kstar.tolist() == [2]
    assert res.survival.tolist() == [[1.0, 0.0, 0.0]]
    # brute force over target ids
    for k in range(3):
        assert res.accept[0, k].item() == float(d2t[draft_logits[0, k].argmax()].item() == p_argmax[0, k].item())


def test_target_dist_matches_full_softmax():
    gen = torch.Generator().manual_seed(3)
    V, d2t = 12, torch.tensor([1, 3, 4, 7, 11])
    logits = torch.randn(2, 3, V, generator=gen) * 3
    for chunk in (None, 4):
        td = target_dist(logits, d2t, chunk_size=chunk)
        p = logits.softmax(-1)
        sub = p[..., d2t]
        assert torch.allclose(td.mass, sub.sum(-1), atol=1e-6)
        assert torch.allclose(td.probs, sub / sub.sum(-1, keepdim=True), atol=1e-6)
        assert torch.allclose(td.probs_on_draft(), sub, atol=1e-6)
        assert torch.equal(td.argmax, p.argmax(-1))
        t2d = {int(t): i for i, t in enumerate(d2t)}
        for a, ad in zip(td.argmax.reshape(-1).tolist(), td.argmax_draft.reshape(-1).tolist()):
            assert ad == t2d.get(a, -1)
    full = target_dist(logits)
    assert torch.allclose(full.probs, logits.softmax(-1)) and torch.all(full.mass == 1)
    assert target_to_draft_index(d2t, V).tolist() == [-1, 0, -1, 1, 2, -1, -1, 3, -1, -1, -1, 4]


def test_target_dist_without_probs_keeps_argmax_and_mass_and_greedy_verification():
    """with_probs=False (greedy acceptance, no soft CE): the same argmax, draft argmax, mass and greedy verification
    as the full build, no probability tensor, and a clear error where p itself is asked for."""
    gen = torch.Generator().manual_seed(4)
    V, d2t = 12, torch.tensor([1, 3, 4, 7, 11])
    logits = torch.randn(2, 6, V, generator=gen) * 3
    for mapping in (d2t, None):
        full, lean = target_dist(logits, mapping), target_dist(logits, mapping, chunk_size=5, with_probs=False)
        assert lean.probs is None
        for name in ("argmax", "argmax_draft", "mass"):
            torch.testing.assert_close(getattr(lean, name), getattr(full, name))
        K = 3
        (g_full, valid), (g_lean, _) = full.gather_ttt(K), lean.gather_ttt(K)
        assert g_lean.probs is None
        draft = torch.randn(2, 6, K, 5 if mapping is not None else V, generator=gen)
        a = simulate_verification(draft, g_full, valid, acceptance="greedy")
        b = simulate_verification(draft, g_lean, valid, acceptance="greedy")
        torch.testing.assert_close(a.accept, b.accept)
        with pytest.raises(ValueError, match="without probabilities"):
            simulate_verification(draft, g_lean, valid, acceptance="expected")


def test_expected_acceptance_equals_sum_min_brute_force():
    gen = torch.Generator().manual_seed(4)
    V, d2t = 9, torch.tensor([0, 2, 3, 5, 8])
    K = 3
    target_logits = torch.randn(4, K, V, generator=gen)
    draft_logits = torch.randn(4, K, 5, generator=gen)
    res = simulate_verification(draft_logits, target_logits, acceptance="expected", draft_to_target=d2t)
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    for i in range(4):
        for k in range(K):
            q_full = [0.0] * V
            for dv in range(5):
                q_full[int(d2t[dv])] = q[i, k, dv].item()
            alpha = sum(min(p[i, k, v].item(), q_full[v]) for v in range(V))
            assert res.accept[i, k].item() == pytest.approx(alpha, abs=1e-6)
    # survival is the product of the α's
    assert torch.allclose(res.survival, torch.cumprod(res.accept, -1))
    # identical distributions accept with probability 1
    same = torch.randn(2, K, V, generator=gen)
    assert torch.allclose(expected_accept(same.softmax(-1), same.softmax(-1)), torch.ones(2, K), atol=1e-5)


def test_sampled_acceptance_mean_matches_expected():
    gen = torch.Generator().manual_seed(5)
    V, d2t = 8, torch.tensor([0, 1, 3, 4, 6])
    target_logits = torch.randn(6, V, generator=gen)
    draft_logits = torch.randn(6, 5, generator=gen)
    td = target_dist(target_logits, d2t)
    q = draft_logits.softmax(-1)
    alpha = expected_accept(q, td.probs_on_draft())  # (6,)
    n = 20000
    g = torch.Generator().manual_seed(123)
    draws = sampled_accept(q.expand(n, 6, 5), td.probs_on_draft().expand(n, 6, 5), generator=g)  # (n, 6)
    assert set(draws.unique().tolist()) <= {0.0, 1.0}
    assert torch.allclose(draws.mean(0), alpha, atol=0.015)  # 4.5 sigma at n = 20000
    # the generator makes draws reproducible
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    res1 = simulate_verification(
        draft_logits.view(2, 3, 5), target_logits.view(2, 3, V), acceptance="sampled", draft_to_target=d2t, generator=g1
    )
    res2 = simulate_verification(
        draft_logits.view(2, 3, 5), target_logits.view(2, 3, V), acceptance="sampled", draft_to_target=d2t, generator=g2
    )
    assert torch.equal(res1.accept, res2.accept)


def test_unknown_acceptance_rule():
    with pytest.raises(ValueError, match="acceptance"):
        simulate_verification(torch.randn(1, 2, 3), torch.randn(1, 2, 3), acceptance="beam")


# ---------------------------------------------------------------------------------------------------- gathering


def test_gather_ttt_targets_brute_force():
    B, T, K, V = 2, 9, 3, 4
    x = torch.randn(B, T, V)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0, 0]])
    attn = torch.tensor([[0, 0] + [1] * 7, [1] * 7 + [0, 0]])  # left padding, right padding
    g, valid = gather_ttt_targets(x, K, loss_mask, attn)
    assert g.shape == (B, T, K, V) and valid.shape == (B, T, K)
    for b in range(B):
        for t in range(T):
            for k in range(K):
                idx = t + 1 + k
                exists = idx <= T - 2
                ok = exists and loss_mask[b, t + 2 + k] == 1 and attn[b, t + 2 + k] == 1 and attn[b, t] == 1
                assert bool(valid[b, t, k]) == bool(ok), (b, t, k)
                if idx <= T - 1:
                    assert torch.equal(g[b, t, k], x[b, idx])
    # integer per-position tensors too, and without masks validity is existence only
    gi, vi = gather_ttt_targets(torch.arange(T).expand(B, T), K)
    assert gi[0, 0].tolist() == [1, 2, 3] and vi[0, T - 3].tolist() == [True, False, False]
    assert not vi[0, T - 2 :].any()


def test_gather_block_targets_brute_force():
    B, T, K = 2, 8, 3
    x = torch.randn(B, T, 5)
    anchors = torch.tensor([[0, 4, 6], [2, -1, 5]])
    loss_mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]])
    g, valid = gather_block_targets(x, anchors, K, loss_mask)
    for b in range(B):
        for n in range(3):
            a = int(anchors[b, n])
            for k in range(K):
                ok = a >= 0 and a + 1 + k <= T - 1 and loss_mask[b, a + 1 + k] == 1
                assert bool(valid[b, n, k]) == bool(ok)
                if ok:
                    assert torch.equal(g[b, n, k], x[b, a + k])


def test_target_dist_gather_ttt_consistent_with_per_step_target():
    gen = torch.Generator().manual_seed(7)
    B, T, K, V = 2, 7, 3, 11
    d2t = torch.tensor([0, 1, 2, 5, 7, 10])
    logits = torch.randn(B, T, V, generator=gen)
    td_k, valid = target_dist(logits, d2t).gather_ttt(K, torch.ones(B, T))
    direct = target_dist(gather_ttt_targets(logits, K)[0], d2t)
    for name in ("argmax", "argmax_draft", "probs", "mass"):
        a, b = getattr(td_k, name), getattr(direct, name)
        assert torch.allclose(a[valid].float(), b[valid].float(), atol=1e-6), name


# ---- on-policy chain: censoring after the first data token that is not the target's argmax ---------------------------


def _bf_censor(input_ids, argmax, K):
    """Step k at anchor t is observed iff input_ids[t+1+j] == argmax[t+j] for j = 1..k (plain loops)."""
    B, T = input_ids.shape
    out = torch.zeros(B, T, K, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for k in range(K):
                observed = True
                for j in range(1, k + 1):
                    i = t + j
                    if i + 1 < T and int(input_ids[b, i + 1]) != int(argmax[b, i]):
                        observed = False
                out[b, t, k] = not observed
    return out


@pytest.mark.parametrize("K", [1, 3, 5])
def test_onpolicy_censor_matches_brute_force(K):
    gen = torch.Generator().manual_seed(K)
    input_ids = torch.randint(0, 3, (3, 12), generator=gen)
    argmax = torch.randint(0, 3, (3, 12), generator=gen)
    got = onpolicy_censor(input_ids, argmax, K)
    assert torch.equal(got, _bf_censor(input_ids, argmax, K))
    assert not got[..., 0].any()  # step 0 is always observed
    # the target's own text (argmax[i] = input_ids[i + 1]) censors nothing
    own = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    assert not onpolicy_censor(input_ids, own, K).any()


def test_censored_positions_are_unknown_not_rejected():
    # one anchor, K = 4: steps 0,1 accepted, step 2 onwards censored -> no observed rejection
    Vd = 5
    target = target_dist(torch.eye(Vd)[[0, 1, 2, 3]][None] * 10)  # argmax 0,1,2,3
    draft = (torch.eye(Vd)[[0, 1, 4, 4]][None] * 10)  # steps 2,3 would be rejected
    valid = torch.ones(1, 4, dtype=torch.bool)
    censored = torch.tensor([[False, False, True, True]])
    plain = simulate_verification(draft, target, valid)
    cens = simulate_verification(draft, target, valid, censored=censored)
    assert int(plain.kstar) == 3 and int(cens.kstar) == 3  # the base decay restarts at the first censored position
    assert cens.valid.tolist() == [[True, True, False, False]]
    assert cens.survival.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert float(cens.tau_sum) == 3.0 and cens.acc_count.tolist() == [1.0, 1.0, 0.0, 0.0]
    # a rejection before the censoring is still a rejection
    early = simulate_verification(torch.eye(Vd)[[4, 1, 4, 4]][None] * 10, target, valid, censored=censored)
    assert int(early.kstar) == 1 and early.survival.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def _brute_censored_weights(accept: list[float], censored: list[bool], base: list[float]) -> list[float]:
    """The censoring rule from its definition: enumerate every accept / reject outcome of the observed positions
    (probability Π m or 1 - m), take k* = the first rejection, else the first censored position, else K + 1, and
    average ŵ_k = 1 for k <= k*, w_base(k - k* + 1) after."""
    import itertools

    K = len(accept)
    first_censored = next((k + 1 for k, c in enumerate(censored) if c), K + 1)
    weights = [0.0] * K
    for outcome in itertools.product([0, 1], repeat=K):
        prob = 1.0
        for k in range(K):
            if not censored[k]:
                prob *= accept[k] if outcome[k] else 1.0 - accept[k]
            elif outcome[k]:  # censored positions have no outcome: count each path once
                prob = 0.0
        if prob == 0.0:
            continue
        kstar = next((k + 1 for k in range(K) if not censored[k] and not outcome[k]), None)
        kstar = min(kstar or K + 1, first_censored)
        for k in range(1, K + 1):
            weights[k - 1] += prob * (1.0 if k <= kstar else base[k - kstar])
    return weights


@pytest.mark.parametrize("acceptance", ["greedy", "expected"])
def test_censored_weights_restart_the_base_decay_brute_force(acceptance):
    from vat.losses import adaptive_weights

    K, Vd = 5, 6
    base = torch.tensor([0.8**k for k in range(K)])
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        draft = torch.randn(1, K, Vd, generator=gen) * 2
        target = torch.randn(1, K, Vd, generator=gen) * 2
        if acceptance == "greedy":  # make some positions accepted
            agree = torch.rand(1, K, generator=gen) < 0.7
            target = torch.where(agree[..., None], draft * 3, target)
        start = int(torch.randint(1, K + 1, (1,), generator=gen))  # first censored position (K = none)
        censored = torch.arange(K)[None] >= start
        result = simulate_verification(draft, target_dist(target), acceptance=acceptance, censored=censored)
        got = adaptive_weights(result.kstar_probs, base)[0].tolist()
        m = (greedy_accept(draft, target_dist(target).argmax_draft) if acceptance == "greedy"
             else expected_accept(draft.softmax(-1), target_dist(target).probs_on_draft()))[0].tolist()
        want = _brute_censored_weights(m, censored[0].tolist(), base.tolist())
        assert got == pytest.approx(want, abs=1e-5), (m, start)
