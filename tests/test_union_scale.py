"""λ with one meaning: the union scale s is 0 before the affinity table is informative, measured over a warm-up and
frozen, and corrected for the anchor sample, so that the union term's expected gradient on the batch's draft logits
is λ times the imitation term's (checked with autograd on the final loss, not with the scale's own arithmetic)."""

from __future__ import annotations

import itertools

import pytest
import torch

from vat.losses import LossSwitches, vat_objective
from vat.union_scale import UnionScale, batch_norms
from vat.verify import simulate_verification, target_dist

SWITCHES = dict(soft_weight=1.0, hard_weight=1.0, adaptive_weights=True, union_top_m=4)


def _case(N=12, K=3, Vd=10, L=2, E=8, top_k=2, seed=0, copies=False):
    """N anchors (flat leading dim) of K draft positions over a Vd-token draft vocab, a random affinity table of L'
    layers x E experts (top_k per row and layer) and each anchor's routing; ``copies``: every anchor the same."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 if copies else N
    target_logits = torch.randn(n, K, Vd, generator=gen) * 2
    draft_logits = target_logits + torch.randn(n, K, Vd, generator=gen)
    routing = torch.zeros(n, L, E)
    for a in range(n):
        for layer in range(L):
            routing[a, layer, torch.randperm(E, generator=gen)[:top_k]] = 1.0
    if copies:
        target_logits, draft_logits, routing = (x.expand(N, *x.shape[1:]).clone()
                                                for x in (target_logits, draft_logits, routing))
    table = torch.zeros(Vd, L, E)
    for v in range(Vd):
        for layer in range(L):
            table[v, layer, torch.randperm(E, generator=gen)[:top_k]] = 1.0
    d2t = torch.arange(Vd)
    dist = target_dist(target_logits, d2t)  # fields (N, K[, Vd])
    valid = torch.ones(N, K, dtype=torch.bool)
    return draft_logits.requires_grad_(True), dist, valid, table, routing


def _grads(case, lam, anchors=None, state=None):
    """(imitation gradient, union gradient) on the draft logits: autograd of the objective with λ minus without."""
    logits, dist, valid, table, routing = case
    kw = dict(affinity=table, anchor_routing=routing, union_anchors=anchors)
    base, _ = vat_objective(logits, dist, valid, LossSwitches(**SWITCHES), **kw)
    full, metrics = vat_objective(logits, dist, valid, LossSwitches(**SWITCHES, union_weight=lam), union_scale=state,
                                  **kw)
    (g_base,) = torch.autograd.grad(base, logits)
    (g_full,) = torch.autograd.grad(full, logits)
    return g_base, g_full - g_base, metrics


def test_the_sampled_scale_equals_the_full_batch_scale():
    """On a batch of identical anchors every anchor contributes alike, so the scale measured on 3 of 12 anchors must
    equal the one measured on all 12; the uncorrected ratio (the norms on the sample) is 3/12 of it."""
    case = _case(copies=True)
    _, _, all_anchors = _grads(case, 0.2)
    _, _, sampled = _grads(case, 0.2, anchors=torch.tensor([1, 5, 9]))
    s_all, s_sampled = all_anchors["union_scale_sum"].item(), sampled["union_scale_sum"].item()
    assert s_sampled == pytest.approx(s_all, rel=1e-5)
    imit, union = torch.tensor(2.0), torch.tensor(0.5)
    scaled_imit, scaled_union = batch_norms(imit, union, torch.tensor(12.0), torch.tensor(3.0))
    assert float(scaled_imit / scaled_union) == pytest.approx(12 / 3 * float(imit / union))


def test_expected_union_gradient_over_anchor_samples_is_lambda_times_imitation():
    """s frozen at its full-batch value; the union term on every 3-of-6 anchor sample in turn: the mean of its
    gradients is the all-anchor union gradient, whose norm is λ times the imitation gradient's (the meaning of λ)."""
    case = _case(N=6, seed=1)
    lam = 0.3
    state = UnionScale(warmup=1)
    state.informative = True
    _grads(case, lam, state=state)  # the one warm-up step, on all anchors
    state.commit()
    assert state.frozen
    g_imit, g_union_all, _ = _grads(case, lam, state=state)
    assert float(g_union_all.norm() / g_imit.norm()) == pytest.approx(lam, rel=1e-5)
    samples = list(itertools.combinations(range(6), 3))
    mean = sum(_grads(case, lam, anchors=torch.tensor(s), state=state)[1] for s in samples) / len(samples)
    torch.testing.assert_close(mean, g_union_all, rtol=1e-4, atol=1e-7)
    one = _grads(case, lam, anchors=torch.tensor(samples[0]), state=state)[1]
    others = torch.ones(6, dtype=torch.bool)
    others[list(samples[0])] = False
    assert float(one[others].abs().max()) == 0.0  # one sample's union reaches only its anchors


def test_lambda_means_the_same_pull_on_two_target_shapes_after_the_warm_up():
    """A Mixtral-like (2 layers x 8 experts, top-2) and an OLMoE-like (6 x 64, top-8) shape: after a warm-up of 3
    steps on anchor samples, the frozen scale gives the union λ times imitation's gradient on the whole batch
    (within the sampling's spread) on both, where the raw penalty's pull differs by far more between the shapes."""
    lam = 0.2
    for L, E, top_k, seed in ((2, 8, 2, 3), (6, 64, 8, 4)):
        case = _case(N=16, L=L, E=E, top_k=top_k, seed=seed)
        state = UnionScale(warmup=3)
        state.informative = True
        gen = torch.Generator().manual_seed(seed)
        for _ in range(3):  # 3 steps of 2 micro-batches, each on its own sample of 8 anchors
            for _ in range(2):
                _grads(case, lam, anchors=torch.randperm(16, generator=gen)[:8], state=state)
            state.commit()
        assert state.frozen
        frozen = state.value().item()
        g_imit, g_union, metrics = _grads(case, lam, state=state)  # all anchors, with the frozen s
        assert metrics["union_scale_sum"].item() == frozen
        assert float(g_union.norm() / g_imit.norm()) == pytest.approx(lam, rel=0.15)
        assert metrics["union_lambda_eff_sum"].item() == pytest.approx(float(g_union.norm() / g_imit.norm()),
                                                                         rel=1e-4)


def test_nothing_pulls_before_the_table_is_informative():
    case = _case(seed=2)
    state = UnionScale(warmup=2)
    g_imit, g_union, metrics = _grads(case, 0.5, state=state)
    assert float(g_union.abs().max()) == 0.0 and metrics["union_scale_sum"].item() == 0.0
    state.commit()
    assert state.measured == 0 and state.totals is None  # nothing summed while the table is uninformative
    assert metrics["union_lambda_eff_sum"].item() == 0.0 and metrics["union_scale_raw_sum"].item() > 0


def test_the_scale_freezes_after_its_warm_up_and_survives_a_checkpoint():
    state = UnionScale(warmup=2, bound=100.0)
    state.informative = True
    assert state.value().item() == 0.0  # no step measured yet
    state.observe(torch.tensor(4.0), torch.tensor(1.0))
    assert state.value().item() == 0.0  # a step's own norms count from the next step on
    state.commit()
    assert state.value().item() == 4.0
    state.observe(torch.tensor(8.0), torch.tensor(1.0))
    state.observe(torch.tensor(6.0), torch.tensor(2.0))  # a second micro-batch of the same step
    state.commit(reduce_sum=lambda t: 2 * t)  # two ranks that saw the same
    assert state.frozen and state.value().item() == pytest.approx((4 + 28) / (1 + 6))  # ratio of the summed norms
    state.observe(torch.tensor(1000.0), torch.tensor(1.0))
    state.commit()
    assert state.value().item() == pytest.approx(32 / 7)  # frozen
    nan = UnionScale(warmup=2)
    nan.informative = True
    nan.observe(torch.tensor(float("nan")), torch.tensor(1.0))
    nan.commit()
    assert nan.measured == 0 and nan.totals is None  # a skipped non-finite step measures nothing
    again = UnionScale(warmup=2, bound=100.0)
    again.load_state_dict(state.state_dict())
    assert again.frozen and again.value().item() == pytest.approx(32 / 7)
    flat = UnionScale(warmup=1, bound=100.0)
    flat.informative = True
    flat.observe(torch.tensor(1.0), torch.tensor(1e-6))  # a union gradient too flat to be a direction
    flat.commit()
    assert flat.value().item() == 100.0 and bool(flat.clamped())
    with pytest.raises(ValueError, match="warm-up"):
        UnionScale(warmup=0)


def test_a_sampled_subset_reads_only_valid_anchors():
    """The batch's N counts valid anchors only: with half the anchors invalid, sampling all the valid ones gives the
    scale of the unsampled run (no correction where nothing was left out)."""
    logits, dist, valid, table, routing = _case(N=8, seed=5)
    valid = valid.clone()
    valid[4:] = False
    case = (logits, dist, valid, table, routing)
    anchor_valid = simulate_verification(logits.detach(), dist, valid).anchor_valid
    assert int(anchor_valid.sum()) == 4
    _, _, unsampled = _grads(case, 0.2)
    _, _, sampled = _grads(case, 0.2, anchors=anchor_valid.nonzero().squeeze(-1))
    assert sampled["union_scale_sum"].item() == pytest.approx(unsampled["union_scale_sum"].item(), rel=1e-6)
