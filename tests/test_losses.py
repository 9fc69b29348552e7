"""VAT losses (vat/losses.py) and the affinity table (vat/affinity.py) against brute-force Python references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vat.affinity import OnlineAffinity
from vat.config import load_config
from vat.errors import VatError
from vat.losses import (
    LossSwitches,
    _AffinityMix,
    adaptive_weights,
    binary_auc,
    dflash_schedule,
    eagle3_schedule,
    expected_expert_use,
    finalize_metrics,
    hard_ce,
    routing_onehot,
    soft_ce,
    soft_union,
    ttt_anchor_routing,
    union_penalty,
    vat_objective,
    vh_bce,
)
from vat.verify import TargetDist, gather_ttt_targets, kstar_distribution, simulate_verification, target_dist

FEW = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------------------------------------------- brute force


def bf_kstar(m, valid):
    for k in range(len(m)):
        if not (valid[k] and m[k]):
            return k + 1
    return len(m) + 1


def bf_adaptive(kstar: int, base: list[float], prefix_only: bool = False) -> list[float]:
    """1-indexed: ŵ_k = 1 for k <= k*, w_base(k - k* + 1) after (0 with prefix_only)."""
    out = []
    for k in range(1, len(base) + 1):
        if k <= kstar:
            out.append(1.0)
        else:
            out.append(0.0 if prefix_only else base[k - kstar + 1 - 1])
    return out


# ---------------------------------------------------------------------------------------------------- schedules and weights


def test_base_schedules():
    assert eagle3_schedule(4).tolist() == pytest.approx([1.0, 0.8, 0.64, 0.512])
    assert dflash_schedule(3, 7.0).tolist() == pytest.approx([1.0, math.exp(-1 / 7), math.exp(-2 / 7)])
    assert LossSwitches(kind="dflash").base_weights(15).tolist() == pytest.approx(dflash_schedule(15, 7.0).tolist())
    assert LossSwitches(kind="dflash", dflash_gamma=3.0).base_weights(2).tolist() == pytest.approx(
        [1.0, math.exp(-1 / 3)]
    )


CASES = {  # m, valid, expected k*
    "no_rejection": ([1, 1, 1, 1, 1], [True] * 5, 6),
    "reject_step1": ([0, 1, 1, 1, 1], [True] * 5, 1),
    "reject_last": ([1, 1, 1, 1, 0], [True] * 5, 5),
    "masked": ([1, 1, 1, 1, 1], [True, True, False, True, True], 3),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_adaptive_weights_cases(name, kind):
    m, valid, kstar = CASES[name]
    base = LossSwitches(kind=kind).base_weights(5)
    res = simulate_verification(
        torch.nn.functional.one_hot(torch.tensor([m]), 2).float() * 5,  # draft argmax = m (draft ids 0/1)
        TargetDist(
            argmax=torch.ones(1, 5, dtype=torch.long),
            argmax_draft=torch.ones(1, 5, dtype=torch.long),
            probs=torch.full((1, 5, 2), 0.5),
            mass=torch.ones(1, 5),
        ),
        torch.tensor([valid]),
    )
    assert res.kstar.item() == kstar == bf_kstar(m, valid)
    w = adaptive_weights(res.kstar, base)
    assert w[0].tolist() == pytest.approx(bf_adaptive(kstar, base.tolist()))
    assert torch.allclose(adaptive_weights(res.kstar_probs, base), w)  # one-hot distribution = hard path
    assert (w > 0).all()  # never zero by construction
    if name == "no_rejection" or name == "reject_last":
        assert torch.all(w == 1)
    if name == "reject_step1":
        assert torch.allclose(w[0], base)  # the base schedule anchored at k* = 1
    wp = adaptive_weights(res.kstar, base, prefix_only=True)
    assert wp[0].tolist() == pytest.approx(bf_adaptive(kstar, base.tolist(), prefix_only=True))


@FEW
@given(st.lists(st.integers(1, 7), min_size=1, max_size=10), st.floats(0.1, 1.0))
def test_adaptive_weights_property(kstars, decay):
    base = eagle3_schedule(6, decay)
    w = adaptive_weights(torch.tensor(kstars), base)
    wp = adaptive_weights(torch.tensor(kstars), base, prefix_only=True)
    assert not w.requires_grad
    for i, ks in enumerate(kstars):
        assert w[i].tolist() == pytest.approx(bf_adaptive(ks, base.tolist()))
        assert wp[i].tolist() == pytest.approx(bf_adaptive(ks, base.tolist(), prefix_only=True))
        assert w[i, : min(ks, 6)].eq(1).all() and (w[i] > 0).all()


def test_expected_adaptive_weights_are_the_expectation():
    alpha = torch.tensor([[0.9, 0.5, 0.2, 0.7]])
    base = eagle3_schedule(4)
    probs = kstar_distribution(alpha)
    w = adaptive_weights(probs, base)
    # brute force: enumerate all 2^4 accept patterns with independent Bernoulli(α)
    expect = [0.0] * 4
    for bits in range(16):
        m = [(bits >> k) & 1 for k in range(4)]
        pr = math.prod(alpha[0, k].item() if m[k] else 1 - alpha[0, k].item() for k in range(4))
        ks = bf_kstar(m, [True] * 4)
        for k, wk in enumerate(bf_adaptive(ks, base.tolist())):
            expect[k] += pr * wk
    assert w[0].tolist() == pytest.approx(expect, abs=1e-6)


def test_adaptive_weights_carry_no_gradient():
    torch.manual_seed(0)
    draft_logits = torch.randn(2, 3, 4, 6, requires_grad=True)
    target = target_dist(torch.randn(2, 3, 4, 6))
    res = simulate_verification(draft_logits, target)
    w = adaptive_weights(res.kstar_probs, eagle3_schedule(4))
    assert not w.requires_grad and not res.survival.requires_grad and not res.kstar_probs.requires_grad
    # the objective's gradient equals that of Σ w_const · ce / N_anchors (the paper's per-anchor sum over k)
    sw = LossSwitches(soft_weight=1.0, hard_weight=1.0, adaptive_weights=True)
    valid = torch.ones(2, 3, 4, dtype=torch.bool)
    loss, _ = vat_objective(draft_logits, target, valid, sw, verification=res)
    (g,) = torch.autograd.grad(loss, draft_logits)
    ce = soft_ce(draft_logits, target.probs) + hard_ce(draft_logits, target.argmax_draft)
    ref = (w * ce).sum() / (2 * 3)
    (g_ref,) = torch.autograd.grad(ref, draft_logits)
    assert torch.allclose(loss, ref, atol=1e-6) and torch.allclose(g, g_ref, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- imitation terms


def test_soft_and_hard_ce_brute_force():
    torch.manual_seed(1)
    logits = torch.randn(3, 5)
    p = torch.randn(3, 5).softmax(-1)
    ids = torch.tensor([2, -1, 4])
    s, h = soft_ce(logits, p), hard_ce(logits, ids)
    for i in range(3):
        lse = math.log(sum(math.exp(x) for x in logits[i].tolist()))
        assert s[i].item() == pytest.approx(
            -sum(p[i, v].item() * (logits[i, v].item() - lse) for v in range(5)), abs=1e-5
        )
        assert h[i].item() == pytest.approx(0.0 if ids[i] < 0 else lse - logits[i, ids[i]].item(), abs=1e-5)


# ---------------------------------------------------------------------------------------------------- verification head


def test_vh_bce_brute_force_and_gradient_reaches_draft_body():
    torch.manual_seed(2)
    B, T, K, H, Vd = 2, 3, 4, 8, 6
    x = torch.randn(B, T, K, H)
    body = torch.nn.Linear(H, H)  # a toy draft body feeding both the lm head and the VH
    lm_head, vh = torch.nn.Linear(H, Vd), torch.nn.Linear(H, 1)
    h = torch.tanh(body(x))
    draft_logits, vh_logits = lm_head(h), vh(h).squeeze(-1)
    target = target_dist(torch.randn(B, T, K, Vd) * 3)
    valid = torch.rand(B, T, K) < 0.8
    res = simulate_verification(draft_logits, target, valid)
    # brute force mean BCE over valid positions
    tot, n = 0.0, 0
    for idx in valid.nonzero().tolist():
        z, y = vh_logits[tuple(idx)].item(), res.survival[tuple(idx)].item()
        sig = 1 / (1 + math.exp(-z))
        tot += -(y * math.log(sig) + (1 - y) * math.log(1 - sig))
        n += 1
    assert vh_bce(vh_logits, res.survival, valid).item() == pytest.approx(tot / n, abs=1e-5)
    # VH alone (imitation off): gradients reach the shared body but not the lm head
    sw = LossSwitches(soft_weight=0.0, hard_weight=0.0, vh_weight=1.0)
    loss, metrics = vat_objective(draft_logits, target, valid, sw, vh_logits=vh_logits, verification=res)
    assert loss.item() == pytest.approx(tot / n, abs=1e-5)
    loss.backward()
    assert body.weight.grad is not None and body.weight.grad.abs().sum() > 0
    assert vh.weight.grad.abs().sum() > 0
    assert lm_head.weight.grad is None or lm_head.weight.grad.abs().sum() == 0
    assert metrics["vh_bce_sum"].item() == pytest.approx(tot, abs=1e-4) and metrics["vh_bce_count"].item() == n


def bf_auc(scores, labels):
    num = den = 0.0
    for i in range(len(scores)):
        for j in range(len(scores)):
            if i == j:
                continue
            wgt = labels[i] * (1 - labels[j])
            den += wgt
            num += wgt * (1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0)
    return num / den if den > 0 else float("nan")


def test_binary_auc_cases():
    assert binary_auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert binary_auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])) == 0.0
    assert binary_auc(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0, 1, 1])) == 0.5
    assert math.isnan(binary_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))


@FEW
@given(
    st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, 0.3])), min_size=2, max_size=25),
)
def test_binary_auc_matches_pairwise(rows):
    scores = [float(s) for s, _ in rows]  # small integer range forces ties
    labels = [y for _, y in rows]
    got = binary_auc(torch.tensor(scores), torch.tensor(labels, dtype=torch.float64))
    ref = bf_auc(scores, labels)
    assert (math.isnan(got) and math.isnan(ref)) or got == pytest.approx(ref, abs=1e-9)


# ---------------------------------------------------------------------------------------------------- expert union


def test_expected_expert_use_brute_force_and_gradcheck():
    torch.manual_seed(3)
    Vd, L, E, m = 7, 2, 5, 3
    table = torch.rand(Vd, L, E)
    logits = torch.randn(2, 3, Vd)
    q = logits.softmax(-1)
    a = expected_expert_use(q, table, top_m=m)
    assert a.shape == (2, 3, L, E)
    for i in range(2):
        for k in range(3):
            top = sorted(range(Vd), key=lambda v: -q[i, k, v].item())[:m]
            z = sum(q[i, k, v].item() for v in top)
            ref = sum(q[i, k, v].item() / z * table[v] for v in top)
            assert torch.allclose(a[i, k], ref, atol=1e-6)
    assert torch.allclose(expected_expert_use(logits, table, top_m=m, is_logits=True), a, atol=1e-6)
    # the custom autograd function against finite differences
    w = torch.rand(4, m, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, Vd, (4, m))
    assert torch.autograd.gradcheck(lambda w_: _AffinityMix.apply(w_, idx, table.double()), (w,))


def test_soft_union_brute_force():
    torch.manual_seed(4)
    N, K, L, E = 3, 4, 2, 5
    a = torch.rand(N, K, L, E)
    r = (torch.rand(N, L, E) < 0.3).float()
    valid = torch.rand(N, K) < 0.7
    U = soft_union(a, r, valid)
    for n in range(N):
        for layer in range(L):
            tot = 0.0
            for e in range(E):
                miss = 1.0
                for k in range(K):
                    if valid[n, k]:
                        miss *= 1 - a[n, k, layer, e].item()
                tot += 1 - (1 - r[n, layer, e].item()) * miss
            assert U[n, layer].item() == pytest.approx(tot, abs=1e-5)
    # invalid steps contribute nothing; with no valid step U is the anchor's own count
    assert torch.allclose(soft_union(a, r, torch.zeros(N, K, dtype=torch.bool)), r.sum(-1))
    pen, total, count = union_penalty(U, E, torch.tensor([True, False, True]))
    assert total.item() == pytest.approx((U[0].sum() + U[2].sum()).item(), abs=1e-5) and count.item() == 2 * L
    assert pen.item() == pytest.approx(total.item() / (count.item() * E), abs=1e-6)


def _toy_table():
    # 2 tokens, 1 layer, 8 experts, top-2: token 0 -> experts {0, 1}, token 1 -> experts {4, 5}
    table = torch.zeros(2, 1, 8)
    table[0, 0, [0, 1]] = 1.0
    table[1, 0, [4, 5]] = 1.0
    return table


def test_union_gradient_moves_mass_to_the_anchors_experts():
    table = _toy_table()
    r = torch.zeros(1, 1, 8)
    r[0, 0, [0, 1]] = 1.0  # the anchor routes to {0, 1}: token 0 overlaps it
    logits = torch.zeros(1, 1, 2, requires_grad=True)  # equally likely tokens
    opt = torch.optim.SGD([logits], lr=5.0)
    first = None
    for _ in range(20):
        a = expected_expert_use(logits, table, top_m=2, is_logits=True)
        pen, total, _ = union_penalty(soft_union(a, r), 8)
        first = total.item() if first is None else first
        opt.zero_grad()
        pen.backward()
        opt.step()
    q = logits.softmax(-1)[0, 0]
    assert first == pytest.approx(3.0)  # {0, 1} + half of {4, 5}
    assert q[0] > 0.9 and total.item() < first


def test_union_gradient_moves_mass_to_the_other_steps_experts():
    table = _toy_table()
    r = torch.zeros(1, 1, 8)
    r[0, 0, 7] = 1.0  # the anchor overlaps neither token
    fixed = torch.tensor([[[4.0, -4.0]]])  # step 0 is confident on token 0 (experts {0, 1}); not trained
    logits = torch.zeros(1, 1, 2, requires_grad=True)  # step 1: equally likely tokens
    opt = torch.optim.SGD([logits], lr=5.0)
    for _ in range(20):
        both = torch.cat([fixed, logits], dim=1)  # (1, K=2, V_d=2)
        pen, _, _ = union_penalty(soft_union(expected_expert_use(both, table, 2, is_logits=True), r), 8)
        opt.zero_grad()
        pen.backward()
        opt.step()
    assert logits.softmax(-1)[0, 0, 0] > 0.9


def test_routing_onehot():
    topk = torch.tensor([[[[0, 2], [1, -1]]], [[[3, 1], [0, 3]]]])  # (L'=2, B=1, T=2, k=2)
    r = routing_onehot(topk, 4)
    assert r.shape == (1, 2, 2, 4)
    assert r[0, 0, 0].tolist() == [1, 0, 1, 0] and r[0, 1, 0].tolist() == [0, 1, 0, 0]
    assert r[0, 0, 1].tolist() == [0, 1, 0, 1] and r[0, 1, 1].tolist() == [1, 0, 0, 1]
    shifted = ttt_anchor_routing(topk, 4)  # anchor t reads the root token t + 1
    assert torch.equal(shifted[0, 0], r[0, 1]) and shifted[0, 1].sum() == 0


# ---------------------------------------------------------------------------------------------------- affinity table


def test_online_affinity_matches_brute_force_ema_and_rows_sum_to_top_k():
    torch.manual_seed(5)
    V, L, E, k, ema, s = 6, 2, 8, 2, 0.9, 3.0
    aff = OnlineAffinity(V, L, E, k, ema=ema, prior_strength=s)
    assert torch.allclose(aff.table(), torch.full((V, L, E), k / E))
    counts = torch.zeros(V, L, E, dtype=torch.float64)
    tok = torch.zeros(V, dtype=torch.float64)
    marg = torch.zeros(L, E, dtype=torch.float64)
    mtot = 0.0
    for _ in range(3):
        B, T = 2, 5
        rows = torch.randint(-1, 4, (B, T))  # rows 4, 5 never seen: they read as the marginal
        topk = torch.stack([torch.randperm(E)[:k] for _ in range(L * B * T)]).view(L, B, T, k)
        valid = torch.rand(B, T) < 0.8
        aff.update(rows, topk, valid)
        counts *= ema
        tok *= ema
        marg *= ema
        mtot *= ema
        for b in range(B):
            for t in range(T):
                if not valid[b, t]:
                    continue
                mtot += 1
                for layer in range(L):
                    for e in topk[layer, b, t].tolist():
                        marg[layer, e] += 1
                        if rows[b, t] >= 0:
                            counts[rows[b, t], layer, e] += 1
                if rows[b, t] >= 0:
                    tok[rows[b, t]] += 1
    ref = (counts + s * marg / mtot) / (tok.view(-1, 1, 1) + s)
    table = aff.table()
    assert torch.allclose(table.double(), ref, atol=1e-5)
    assert torch.allclose(table.sum(-1), torch.full((V, L), float(k)), atol=1e-5)
    assert torch.allclose(table[4], aff.marginal(), atol=1e-6) and torch.allclose(table[5], aff.marginal(), atol=1e-6)


def test_online_affinity_frequent_token_converges_and_state_round_trip(tmp_path):
    V, L, E, k = 3, 1, 4, 2
    aff = OnlineAffinity(V, L, E, k, ema=0.9, prior_strength=1.0)
    rows = torch.zeros(1, 50, dtype=torch.long)  # token 0 always routes to {1, 3}
    topk = torch.tensor([1, 3]).expand(1, 1, 50, 2)
    for _ in range(10):
        aff.update(rows, topk)
    assert torch.allclose(aff.table()[0, 0], torch.tensor([0.0, 1.0, 0.0, 1.0]), atol=0.01)
    clone = OnlineAffinity(V, L, E, k)
    clone.load_state_dict(aff.state_dict())
    assert torch.equal(clone.table(), aff.table())
    # a precomputed table (`vat prep affinity`) is used exactly and stays frozen
    from safetensors.torch import save_file

    pre = torch.rand(V, L, E)
    save_file({"affinity": pre}, str(tmp_path / "aff.safetensors"))
    loaded = OnlineAffinity.from_file(str(tmp_path / "aff.safetensors"), top_k=k)
    assert torch.allclose(loaded.table(), pre)
    loaded.update(rows, topk)
    assert torch.allclose(loaded.table(), pre)
    with pytest.raises(VatError, match="not found"):
        OnlineAffinity.from_file(str(tmp_path / "missing.safetensors"), top_k=k)
    with pytest.raises(VatError, match="shape"):
        OnlineAffinity(V + 1, L, E, k).load_table(pre)


# ---------------------------------------------------------------------------------------------------- objective


def _batch(seed=6, B=2, T=10, K=3, V=16, Vd=8):
    gen = torch.Generator().manual_seed(seed)
    d2t = torch.sort(torch.randperm(V, generator=gen)[:Vd]).values
    target_logits = torch.randn(B, T, V, generator=gen) * 2
    loss_mask = (torch.rand(B, T, generator=gen) < 0.8).long()
    td_k, valid = target_dist(target_logits, d2t).gather_ttt(K, loss_mask)
    # draft logits correlated with the target so that some chains survive
    draft_logits = gather_ttt_targets(target_logits[..., d2t], K)[0] + torch.randn(B, T, K, Vd, generator=gen)
    return target_logits, d2t, loss_mask, td_k, valid, draft_logits.clone().requires_grad_(True)


def test_eagle3_preset_equals_hand_computed_loss():
    target_logits, d2t, loss_mask, td_k, valid, draft_logits = _batch()
    cfg = load_config(None, ["method=eagle3"])
    sw = LossSwitches.from_config(cfg.loss, kind=cfg.drafter.kind)
    assert (sw.adaptive_weights, sw.vh_weight, sw.hard_weight, sw.union_weight) == (False, 0.0, 0.0, 0.0)
    loss, metrics = vat_objective(draft_logits, td_k, valid, sw)
    B, T, _ = target_logits.shape
    K = draft_logits.shape[2]
    num = den = 0.0
    anchors = set()
    for b in range(B):
        for t in range(T):
            for k in range(K):
                idx = t + 1 + k
                if idx > T - 2 or loss_mask[b, t + 2 + k] == 0:
                    continue
                p_full = target_logits[b, idx].softmax(-1)
                if int(p_full.argmax()) not in d2t.tolist():
                    continue  # target argmax outside the draft vocab: masked
                p = p_full[d2t] / p_full[d2t].sum()
                logq = draft_logits[b, t, k].detach().log_softmax(-1)
                ce = -(p * logq).sum().item()
                num += 0.8**k * ce
                den += 0.8**k
                anchors.add((b, t))
    assert loss.item() == pytest.approx(num / len(anchors), rel=1e-5)
    assert metrics["imitation_anchors"].item() == len(anchors)
    assert metrics["weight_sum"].item() == pytest.approx(den, rel=1e-6)
    assert "vh_bce_sum" not in metrics and "union_sim_sum" not in metrics


def test_vat_objective_all_terms_brute_force():
    _, _, _, td_k, valid, draft_logits = _batch(seed=7)
    B, T, K, Vd = draft_logits.shape
    L, E = 2, 6
    gen = torch.Generator().manual_seed(0)
    table = torch.rand(Vd, L, E, generator=gen)
    anchor_routing = (torch.rand(B, T, L, E, generator=gen) < 0.3).float()
    vh_logits = torch.randn(B, T, K, generator=gen, requires_grad=True)
    sw = LossSwitches(
        soft_weight=1.0, hard_weight=0.5, adaptive_weights=True, vh_weight=1.0, union_weight=0.1, union_top_m=3,
        union_norm="none",
    )
    loss, metrics = vat_objective(
        draft_logits, td_k, valid, sw, vh_logits=vh_logits, affinity=table, anchor_routing=anchor_routing
    )
    base = eagle3_schedule(K).tolist()
    num = den = bce = nb = usum = ucount = tau = anchors = imit_anchors = 0.0
    for b in range(B):
        for t in range(T):
            q = draft_logits[b, t].detach()
            m = [int(q[k].argmax() == td_k.argmax_draft[b, t, k]) for k in range(K)]
            vk = valid[b, t].tolist()
            ks = bf_kstar(m, vk)
            w = bf_adaptive(ks, base)
            if vk[0]:
                anchors += 1
                tau += ks  # 1 + accepted = k*
            imit_anchors += any(vk[k] and int(td_k.argmax_draft[b, t, k]) >= 0 for k in range(K))
            for k in range(K):
                if not vk[k]:
                    continue
                y = 1.0 if k + 1 < ks else 0.0
                z = vh_logits[b, t, k].item()
                bce += max(z, 0) - z * y + math.log1p(math.exp(-abs(z)))
                nb += 1
                tid = int(td_k.argmax_draft[b, t, k])
                if tid < 0:
                    continue
                logq = q[k].log_softmax(-1)
                ce = -(td_k.probs[b, t, k] * logq).sum().item() + 0.5 * -logq[tid].item()
                num += w[k] * ce
                den += w[k]
            if vk[0]:
                for layer in range(L):
                    miss = torch.ones(E)
                    for k in range(K):
                        if vk[k]:
                            p = q[k].softmax(-1)
                            top = torch.topk(p, 3).indices
                            a = (p[top, None] / p[top].sum() * table[top, layer]).sum(0)
                            miss = miss * (1 - a)
                    usum += (1 - (1 - anchor_routing[b, t, layer]) * miss).sum().item()
                    ucount += 1
    expect = num / imit_anchors + bce / nb + 0.1 * usum / (ucount * E)
    assert loss.item() == pytest.approx(expect, rel=1e-5)
    assert metrics["tau_sim_sum"].item() == pytest.approx(tau) and metrics["tau_sim_count"].item() == anchors
    assert metrics["union_sim_sum"].item() == pytest.approx(usum, rel=1e-5)
    assert metrics["union_sim_count"].item() == ucount
    loss.backward()
    assert draft_logits.grad.abs().sum() > 0 and vh_logits.grad.abs().sum() > 0
    # the union term only logs when its weight is 0, and the switches remove each term
    sw0 = LossSwitches(soft_weight=1.0, hard_weight=0.5, adaptive_weights=True, union_top_m=3)
    loss0, metrics0 = vat_objective(draft_logits, td_k, valid, sw0, affinity=table, anchor_routing=anchor_routing)
    assert loss0.item() == pytest.approx(num / imit_anchors, rel=1e-5)
    assert metrics0["union_sim_sum"].item() == pytest.approx(usum, rel=1e-5)


def test_objective_switch_errors_and_metrics_finalize():
    _, _, _, td_k, valid, draft_logits = _batch(seed=8)
    with pytest.raises(ValueError, match="vh_logits"):
        vat_objective(draft_logits, td_k, valid, LossSwitches(vh_weight=1.0))
    with pytest.raises(ValueError, match="affinity"):
        vat_objective(draft_logits, td_k, valid, LossSwitches(union_weight=1.0))
    with pytest.raises(VatError, match="acceptance"):
        LossSwitches(acceptance="beam")
    # an empty batch gives a zero (finite) loss with a graph
    loss, metrics = vat_objective(draft_logits, td_k, torch.zeros_like(valid), LossSwitches())
    assert loss.item() == 0.0 and loss.requires_grad
    out = finalize_metrics(metrics)
    assert math.isnan(out["tau_sim"]) and len(out["acc_k"]) == draft_logits.shape[2]
    _, metrics = vat_objective(draft_logits, td_k, valid, LossSwitches())
    out = finalize_metrics(metrics)
    assert out["tau_sim"] == pytest.approx((metrics["tau_sim_sum"] / metrics["tau_sim_count"]).item())
    assert out["loss_k"][0] == pytest.approx((metrics["loss_k_sum"][0] / metrics["loss_k_count"][0]).item())


@pytest.mark.parametrize("method", ["eagle3", "vat", "dflash", "dflash_vat"])
def test_switches_from_config_presets(method):
    cfg = load_config(None, [f"method={method}", "drafter.block_size=8"])
    sw = LossSwitches.from_config(cfg.loss, kind=cfg.drafter.kind, block_size=cfg.drafter.block_size)
    assert sw.adaptive_weights == method.endswith("vat")
    assert sw.vh_weight == (1.0 if method.endswith("vat") else 0.0)
    assert sw.kind == ("dflash" if method.startswith("dflash") else "eagle3")
    if sw.kind == "dflash":
        assert sw.dflash_gamma == pytest.approx(3.5)


@pytest.mark.parametrize("acceptance", ["expected", "sampled"])
def test_stochastic_acceptance_in_objective(acceptance):
    _, _, _, td_k, valid, draft_logits = _batch(seed=9)
    sw = LossSwitches(adaptive_weights=True, acceptance=acceptance)
    loss, metrics = vat_objective(draft_logits, td_k, valid, sw, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)
    out = finalize_metrics(metrics)
    assert 1.0 <= out["tau_sim"] <= 1.0 + draft_logits.shape[2]


def test_union_on_sampled_anchors_equals_union_on_those_anchors_alone():
    from vat.losses import LossSwitches, vat_objective

    torch.manual_seed(3)
    N, K, V, L, E = 10, 4, 12, 2, 6
    logits = torch.randn(N, K, V, requires_grad=True)
    target = target_dist(torch.randn(N, K, V))
    valid = torch.rand(N, K) > 0.2
    valid[:, 0] = True
    affinity = torch.rand(V, L, E)
    routing = (torch.rand(N, L, E) > 0.6).float()
    switches = LossSwitches(union_weight=1.0)
    idx = torch.tensor([1, 4, 7])
    _, sub = vat_objective(logits, target, valid, switches, affinity=affinity, anchor_routing=routing,
                           union_anchors=idx)
    sliced = target.apply(lambda x: x[idx])
    _, alone = vat_objective(logits[idx], sliced, valid[idx], switches, affinity=affinity, anchor_routing=routing[idx])
    assert torch.allclose(sub["union_sim_sum"], alone["union_sim_sum"])
    assert torch.equal(sub["union_sim_count"], alone["union_sim_count"])


# ---- lambda normalisation: the union term's gradient is lambda times imitation's, on any target shape -----------------


def _union_case(L, E, top_k, Vd, seed):
    """A batch with an affinity table of L' layers x E experts, each row spreading top_k experts per layer."""
    _, _, _, td_k, valid, _ = _batch(seed=seed, V=2 * Vd, Vd=Vd)
    gen = torch.Generator().manual_seed(seed)
    B, T, K = valid.shape
    draft_logits = (torch.randn(B, T, K, Vd, generator=gen) * 2).requires_grad_(True)
    table = torch.zeros(Vd, L, E)
    for v in range(Vd):
        for layer in range(L):
            table[v, layer, torch.randperm(E, generator=gen)[:top_k]] = 1.0
    routing = torch.zeros(B, T, L, E)
    routing[..., :top_k] = 1.0
    return draft_logits, td_k, valid, table, routing


def _gradient_ratio(case, lam, norm):
    draft_logits, td_k, valid, table, routing = case
    sw = dict(soft_weight=1.0, hard_weight=1.0, adaptive_weights=True, union_top_m=4, union_norm=norm)
    base, _ = vat_objective(draft_logits, td_k, valid, LossSwitches(**sw), affinity=table, anchor_routing=routing)
    full, m = vat_objective(draft_logits, td_k, valid, LossSwitches(**sw, union_weight=lam), affinity=table,
                            anchor_routing=routing)
    (g_base,) = torch.autograd.grad(base, draft_logits)
    (g_full,) = torch.autograd.grad(full, draft_logits)
    return float((g_full - g_base).norm() / g_base.norm()), m


def test_union_lambda_is_the_same_gradient_ratio_on_two_target_shapes():
    small = _union_case(L=2, E=8, top_k=2, Vd=12, seed=3)  # a Mixtral-like shape
    large = _union_case(L=6, E=64, top_k=8, Vd=12, seed=4)  # an OLMoE-like shape
    for lam in (0.05, 0.3):
        r_small, m = _gradient_ratio(small, lam, "grad_ratio")
        r_large, _ = _gradient_ratio(large, lam, "grad_ratio")
        assert r_small == pytest.approx(lam, rel=1e-4) and r_large == pytest.approx(lam, rel=1e-4)
        assert m["union_scale_sum"].item() > 0
    # the raw U/E penalty does not mean the same on both shapes (what the normalisation is for)
    raw_small, _ = _gradient_ratio(small, 0.3, "none")
    raw_large, _ = _gradient_ratio(large, 0.3, "none")
    assert abs(raw_small / raw_large - 1) > 0.2


def test_union_lambda_ratio_on_sampled_anchors():
    draft_logits, td_k, valid, table, routing = _union_case(L=3, E=16, top_k=4, Vd=12, seed=5)
    B, T, K, _ = draft_logits.shape
    anchors = torch.tensor([0, 3, 7, 12])  # flat (b, t) indices
    sw = dict(soft_weight=1.0, hard_weight=0.0, adaptive_weights=False, union_top_m=4)
    base, _ = vat_objective(draft_logits, td_k, valid, LossSwitches(**sw), affinity=table, anchor_routing=routing,
                            union_anchors=anchors)
    full, _ = vat_objective(draft_logits, td_k, valid, LossSwitches(**sw, union_weight=0.2), affinity=table,
                            anchor_routing=routing, union_anchors=anchors)
    (g_base,) = torch.autograd.grad(base, draft_logits)
    (g_full,) = torch.autograd.grad(full, draft_logits)
    rows = g_base.reshape(-1, K, g_base.shape[-1])[anchors]  # imitation's gradient on the sampled anchors
    extra = (g_full - g_base).reshape(-1, K, g_base.shape[-1])
    # λ is the pull on the whole batch: on the M sampled anchors of N the union stands in for all N, so there it pulls
    # N/M times harder than imitation's gradient on the same logits (tests/test_union_scale.py: the expectation)
    anchor_valid = simulate_verification(draft_logits.detach(), td_k, valid).anchor_valid.reshape(-1)
    n, m = int(anchor_valid.sum()), int(anchor_valid[anchors].sum())  # valid anchors: in the batch, in the sample
    assert n > m > 0
    assert float(extra[anchors].norm() / rows.norm()) == pytest.approx(0.2 * n / m, rel=1e-4)
    others = torch.ones(B * T, dtype=torch.bool)
    others[anchors] = False
    assert float(extra[others].abs().max()) == 0.0  # the union term reaches only the sampled anchors


def _allocated_bytes(fn) -> int:
    """Bytes the CPU allocator handed out while ``fn`` ran (the profiler's memory events, every op's positive sum)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.key_averages() if e.cpu_memory_usage > 0)


def test_the_union_term_on_sampled_anchors_copies_no_batch_sized_tensor():
    """The target fields in the TTT layout are windows over the per-position tensors (a view): the union term on 16
    sampled anchors must gather those 16 anchors' rows, not reshape (copy) the whole (B, T, K, V_d) view first. Its
    allocations beyond the same objective without the union term stay under half of one batch-sized fp32 tensor
    (the reshape copied 4 of them: 59 MB here)."""
    gen = torch.Generator().manual_seed(0)
    B, T, K, V, L, E = 4, 256, 7, 512, 2, 8
    dist, valid = target_dist(torch.randn(B, T, V, generator=gen)).gather_ttt(K)
    assert not dist.probs.is_contiguous()  # the windows view the test is about
    logits = torch.randn(B, T, K, V, generator=gen, requires_grad=True)
    table, routing = torch.rand(V, L, E, generator=gen), (torch.rand(B, T, L, E, generator=gen) > 0.7).float()
    without = _allocated_bytes(lambda: vat_objective(logits, dist, valid, LossSwitches()))
    union = _allocated_bytes(lambda: vat_objective(logits, dist, valid, LossSwitches(union_weight=0.1), affinity=table,
                                                   anchor_routing=routing, union_anchors=torch.arange(16)))
    batch_sized = B * T * K * V * 4
    assert union - without < 0.5 * batch_sized, (union - without) / batch_sized


def test_logged_objective_takes_the_union_term_unscaled():
    """A fresh draft whose union barely depends on its logits: s = ||∇imit|| / ||∇union|| is huge, so the optimised
    loss is ~λ·s·U/E; the logged objective is imitation + λ·L_union, which stays near the imitation term."""
    draft_logits, td_k, valid, table, routing = _union_case(L=2, E=8, top_k=2, Vd=12, seed=6)
    gen = torch.Generator().manual_seed(6)
    flat = table[:1].expand_as(table) + 1e-7 * torch.rand(table.shape, generator=gen)  # rows almost identical
    sw = dict(soft_weight=1.0, hard_weight=1.0, adaptive_weights=True, union_top_m=4)
    lam = 0.3
    base, mb = vat_objective(draft_logits, td_k, valid, LossSwitches(**sw), affinity=flat, anchor_routing=routing)
    full, m = vat_objective(draft_logits, td_k, valid, LossSwitches(**sw, union_weight=lam, union_scale_max=math.inf),
                            affinity=flat, anchor_routing=routing)
    scale, union = m["union_scale_sum"].item(), m["union_loss_sum"].item()
    assert scale > 1e4  # the situation of the issue: a scale that would blow up the logged number (unbounded here)
    assert 0 < union <= 1.0 and m["union_loss_count"].item() == 1.0
    assert full.item() == pytest.approx(base.item() + lam * scale * union, rel=1e-4)
    assert m["objective_sum"].item() == pytest.approx(base.item() + lam * union, rel=1e-6)
    assert mb["objective_sum"].item() == pytest.approx(base.item(), rel=1e-6) and "union_loss_sum" not in mb
    out = finalize_metrics({k: v for k, v in m.items()})
    assert out["objective"] == pytest.approx(base.item() + lam * union, rel=1e-6) and out["union_scale"] == scale


@pytest.mark.parametrize("stride", [1, 2])
def test_compact_affinity_table_equals_the_dense_one_on_the_tiny_target(stride):
    """The quick tiny target's routing over a few batches of token ids, folded into the dense fp32 table and the
    compact one (uint16 rows, fp16 table, every `stride`-th MoE layer): the tables agree to fp16 / fixed-point
    rounding, the marginals exactly, and the compact state takes under half the dense bytes."""
    from vat.target import load_target
    from vat.target.model import resolve_target_path

    target = load_target(resolve_target_path("tiny-quick"), dtype="float32", device="cpu", experts_impl="eager")
    L, E, k = len(target.moe_layer_ids), target.num_experts, target.top_k
    Vd = 300
    t2d = torch.full((target.vocab_size,), -1, dtype=torch.long)
    t2d[:Vd] = torch.arange(Vd)  # the draft vocab: the first Vd target ids
    dense = OnlineAffinity(Vd, L, E, k, ema=0.9)
    compact = OnlineAffinity(Vd, L, E, k, ema=0.9, storage="uint16", layer_stride=stride)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 2 * Vd, (2, 48), generator=gen)  # (B, T): some tokens outside the draft vocab
        valid = torch.ones(2, 48, dtype=torch.bool)
        valid[1, 40:] = False
        topk = target.forward(ids, output_aux=False).topk_ids  # (L', B, T, k)
        for table in (dense, compact):
            table.fold(*table.select(t2d[ids], topk, valid))
    want = dense.table()[:, ::stride]  # (Vd, L'', E)
    got = compact.table()
    assert got.dtype == torch.float16 and got.shape == want.shape == (Vd, len(range(0, L, stride)), E)
    torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=0)
    torch.testing.assert_close(compact.marginal(), dense.marginal()[::stride], atol=1e-6, rtol=1e-6)
    seen = dense.token_counts > 0
    assert 0 < int(seen.sum()) < Vd  # seen and unseen rows both compared
    torch.testing.assert_close(compact.token_counts, dense.token_counts, atol=1e-5, rtol=1e-6)
    nbytes = lambda m: sum(b.numel() * b.element_size() for b in m.buffers())  # noqa: E731
    assert nbytes(compact) < 0.51 * nbytes(dense) / stride + 4 * Vd + 64
    # the union term reads the fp16 table as it reads the fp32 one
    logits = torch.randn(3, 2, Vd, generator=gen)
    a_c = expected_expert_use(logits, got, 8, is_logits=True)
    a_d = expected_expert_use(logits, want, 8, is_logits=True)
    assert a_c.dtype == torch.float32
    torch.testing.assert_close(a_c, a_d, atol=1e-3, rtol=0)


def test_union_scale_is_bounded_and_leaves_a_working_union_term_alone():
    """grad_ratio's s = ||grad imit|| / ||grad union|| is clamped at ``union_scale_max``: on a table whose rows are
    equal up to fp noise (a fresh run before its first routing fold) s would be ~1e6+ and scale noise up to
    lambda x imitation; bounded, the union adds exactly ``lambda * s_max * grad U``. An informative table's s is far below
    the bound and keeps the exact ratio lambda."""
    draft_logits, td_k, valid, table, routing = _union_case(L=2, E=8, top_k=2, Vd=12, seed=6)
    gen = torch.Generator().manual_seed(6)
    flat = table[:1].expand_as(table) + 1e-4 * torch.rand(table.shape, generator=gen)  # rows almost identical
    sw = dict(soft_weight=1.0, hard_weight=1.0, adaptive_weights=True, union_top_m=4)
    lam, bound = 0.3, 20.0
    base, _ = vat_objective(draft_logits, td_k, valid, LossSwitches(**sw), affinity=flat, anchor_routing=routing)
    (g_base,) = torch.autograd.grad(base, draft_logits)
    full, m = vat_objective(draft_logits, td_k, valid, LossSwitches(**sw, union_weight=lam, union_scale_max=bound),
                            affinity=flat, anchor_routing=routing)
    (g_full,) = torch.autograd.grad(full, draft_logits)
    assert m["union_scale_raw_sum"].item() > 1e3 and m["union_scale_sum"].item() == bound
    assert m["union_clamped_sum"].item() == 1.0
    # reference: the union gradient computed on its own, times lambda * bound
    logits = draft_logits.detach().requires_grad_(True)
    anchor_valid = simulate_verification(draft_logits.detach(), td_k, valid).anchor_valid
    penalty, _, _ = union_penalty(soft_union(expected_expert_use(logits, flat, 4, is_logits=True), routing, valid),
                                  flat.shape[-1], anchor_valid)
    (g_union,) = torch.autograd.grad(penalty, logits)
    expected = lam * bound * g_union
    assert float((g_full - g_base - expected).norm() / expected.norm()) < 1e-2  # up to fp32 cancellation
    assert float((g_full - g_base).norm() / g_base.norm()) < 1e-2 * lam  # noise stays noise
    # the informative table: s below the default bound, exact ratio, nothing clamped
    ratio, m = _gradient_ratio((draft_logits, td_k, valid, table, routing), lam, "grad_ratio")
    assert m["union_scale_sum"].item() == m["union_scale_raw_sum"].item() < LossSwitches().union_scale_max
    assert m["union_clamped_sum"].item() == 0.0 and ratio == pytest.approx(lam, rel=1e-4)
    with pytest.raises(VatError, match="union_scale_max"):
        LossSwitches(union_scale_max=0.0)
