"""The chunked imitation loss equals the autograd reference in value and gradient, on the layouts users hit (the
EAGLE-3 TTT windows view, DFlash blocks, bf16 logits), and allocates one chunk's fp32 tensors, not the batch's; with
the LM head inside the chunks (DFlash's full-vocabulary readout, HeadLogits) the loss, its gradient on the hidden
states, the simulated verification and the whole objective equal the materialised logits', and no batch-sized
(..., K, V) tensor exists."""

from __future__ import annotations

import pytest
import torch
from helpers import PeakTensorBytes

from vat.imitation import HeadLogits, chunked_imitation, imitation_grad_norm
from vat.losses import LossSwitches, vat_objective
from vat.verify import simulate_verification, target_dist


def _reference(logits, probs, ids, imit, soft, hard):
    """The obvious per-position loss, through autograd: soft CE against p plus hard CE on the argmax, 0 off imit."""
    logq = logits.float().log_softmax(-1)
    loss = soft * -(probs * logq).sum(-1) + hard * -logq.gather(-1, ids.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(imit, loss, torch.zeros_like(loss))


def _ttt_case(B=3, T=20, K=4, V=40, Vd=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d2t = torch.sort(torch.randperm(V, generator=gen)[:Vd]).values
    dist, valid = target_dist(torch.randn(B, T, V, generator=gen) * 2, d2t).gather_ttt(K)  # views (B, T, K, ·)
    logits = torch.randn(B, T, K, Vd, generator=gen) * 2
    imit = valid & (dist.argmax_draft >= 0)
    return logits, dist, imit


@pytest.mark.parametrize("soft,hard", [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_equals_autograd_on_the_ttt_windows(soft, hard, chunk):
    logits, dist, imit = _ttt_case()
    assert not dist.probs.is_contiguous() and bool(imit.any()) and not bool(imit.all())
    weights = torch.rand(imit.shape, generator=torch.Generator().manual_seed(1))  # a weighted sum, like the objective
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = chunked_imitation(a, dist.probs, dist.argmax_draft, imit, soft, hard, chunk)
    want = _reference(b, dist.probs, dist.argmax_draft, imit, soft, hard)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_bf16_logits_get_a_bf16_gradient_equal_to_the_fp32_one_to_rounding():
    logits, dist, imit = _ttt_case(seed=2)
    a = logits.to(torch.bfloat16).requires_grad_(True)
    b = logits.to(torch.bfloat16).float().requires_grad_(True)
    chunked_imitation(a, dist.probs, dist.argmax_draft, imit, 1.0, 1.0, 5).sum().backward()
    _reference(b, dist.probs, dist.argmax_draft, imit, 1.0, 1.0).sum().backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad.float(), b.grad, rtol=1e-2, atol=1e-3)


def test_the_objective_is_the_same_chunked_or_not_for_both_drafters():
    """vat_objective with loss.imitation_chunk_mb (the default) and with null (the autograd reference): equal loss,
    metrics and gradient, for the EAGLE-3 recipe (soft CE, anchors) and DFlash's (hard CE, weight-sum normaliser,
    adaptive); 0.01 MiB per chunk is 27 anchors of 4 x 24 fp32 values, so the 60 anchors take 3 chunks."""
    logits, dist, imit = _ttt_case(seed=3)
    valid = imit | (torch.rand(imit.shape, generator=torch.Generator().manual_seed(3)) > 0.5)
    for sw in (dict(soft_weight=1.0), dict(soft_weight=0.0, hard_weight=1.0, imitation_norm="weight_sum",
                                           adaptive_weights=True, kind="dflash")):
        out = []
        for chunk_mb in (None, 0.01):
            x = logits.clone().requires_grad_(True)
            loss, metrics = vat_objective(x, dist, valid, LossSwitches(**sw, imitation_chunk_mb=chunk_mb))
            loss.backward()
            out.append((loss.detach(), metrics["loss_k_sum"], x.grad))
        for ref, got in zip(*out):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_forward_and_backward_hold_a_chunk_not_the_batch():
    """On a (4, 256, 7, 512) TTT batch the autograd reference holds several batch-sized fp32 tensors at once
    (log-probabilities, the product with p, their gradients); the chunked path holds the gradient buffer and one
    64-anchor chunk's transients (1/16 of the batch each)."""
    gen = torch.Generator().manual_seed(4)
    B, T, K, V = 4, 256, 7, 512
    dist, valid = target_dist(torch.randn(B, T, V, generator=gen)).gather_ttt(K)
    batch_sized = B * T * K * V * 4

    def peak(chunk):
        x = torch.randn(B, T, K, V, generator=gen).requires_grad_(True)
        with PeakTensorBytes() as held:
            loss = (chunked_imitation(x, dist.probs, dist.argmax_draft, valid, 1.0, 1.0, chunk) if chunk
                    else _reference(x, dist.probs, dist.argmax_draft, valid, 1.0, 1.0))
            loss.sum().backward()
        return held.peak / batch_sized

    chunked, reference = peak(64), peak(None)
    assert reference > 3.0, reference
    assert chunked < 1.5, chunked


@pytest.mark.parametrize("soft,hard", [(1.0, 0.0), (0.0, 1.0), (0.7, 1.3)])
def test_the_chunked_gradient_norm_is_autograds(soft, hard):
    """The union scale's imitation-gradient norm, a chunk at a time, against autograd of the weighted reference."""
    logits, dist, imit = _ttt_case(seed=5)
    coef = torch.rand(imit.shape, generator=torch.Generator().manual_seed(5)) * imit
    x = logits.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((coef * _reference(x, dist.probs, dist.argmax_draft, imit, soft, hard)).sum(), x)
    for chunk in (3, 10_000):
        got = imitation_grad_norm(logits, dist.probs, dist.argmax_draft, coef, soft, hard, chunk)
        assert float(got) == pytest.approx(float(grad.norm()), rel=1e-6)


# ---- the LM head inside the chunks (HeadLogits) ------------------------------------------------------------------


def _block_case(B=2, N=5, K=3, H=16, V=50, seed=0):
    """DFlash-like: hidden (B, N, K, H), a frozen head (V, H), the target dist over the full vocab per block slot."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N, K, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    dist = target_dist(torch.randn(B, N * K, V, generator=gen) * 2).apply(lambda x: x.reshape(B, N, K, *x.shape[2:]))
    valid = torch.rand(B, N, K, generator=gen) > 0.2
    return hidden, weight, dist, valid


@pytest.mark.parametrize("soft,hard", [(1.0, 0.0), (0.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_head_inside_the_chunks_equals_autograd_through_the_head(soft, hard, chunk):
    hidden, weight, dist, valid = _block_case()
    weights = torch.rand(valid.shape, generator=torch.Generator().manual_seed(1))
    a = hidden.clone().requires_grad_(True)
    b = hidden.clone().requires_grad_(True)
    got = chunked_imitation(HeadLogits(a, weight), dist.probs, dist.argmax_draft, valid, soft, hard, chunk)
    want = _reference(b @ weight.T, dist.probs, dist.argmax_draft, valid, soft, hard)  # materialised, autograd
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_a_trainable_head_gets_autograds_weight_gradient():
    hidden, weight, dist, valid = _block_case(seed=6)
    w1, w2 = weight.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    chunked_imitation(HeadLogits(hidden, w1), dist.probs, dist.argmax_draft, valid, 1.0, 1.0, 2).sum().backward()
    _reference(hidden @ w2.T, dist.probs, dist.argmax_draft, valid, 1.0, 1.0).sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("acceptance", ["greedy", "expected"])
def test_verification_read_from_head_logits_equals_the_materialised_logits(acceptance):
    hidden, weight, dist, valid = _block_case(seed=7, V=40)
    hidden[0, 0] = weight[dist.argmax[0, 0]] * 3  # some slots agree with the target, so acceptance is not all 0
    want = simulate_verification(hidden @ weight.T, dist, valid, acceptance=acceptance)
    got = simulate_verification(HeadLogits(hidden, weight, chunk_mb=0.001), dist, valid, acceptance=acceptance)
    assert float(want.accept.sum()) > 0
    torch.testing.assert_close(got.accept, want.accept, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.kstar_probs, want.kstar_probs)


def test_the_dflash_objective_is_the_same_from_head_logits():
    """vat_objective on HeadLogits against the materialised logits: the DFlash recipe's switches (soft + hard CE,
    weight-sum normaliser, adaptive weights, VH) plus the union term on 4 sampled anchors; equal loss, metrics and
    gradients on the hidden states."""
    hidden, weight, dist, valid = _block_case(seed=8, B=2, N=6, K=3, V=30)
    gen = torch.Generator().manual_seed(8)
    L, E = 2, 6
    affinity = torch.softmax(torch.randn(30, L, E, generator=gen), -1)
    routing = (torch.rand(2, 6, L, E, generator=gen) > 0.6).float()
    vh = torch.randn(2, 6, 3, generator=gen)
    sw = dict(soft_weight=1.0, hard_weight=1.0, imitation_norm="weight_sum", adaptive_weights=True, kind="dflash",
              vh_weight=1.0, union_weight=0.1, union_norm="none", imitation_chunk_mb=0.0005)
    out = []
    for lazy in (False, True):
        x = hidden.clone().requires_grad_(True)
        logits = HeadLogits(x, weight, chunk_mb=0.0005) if lazy else x @ weight.T
        loss, metrics = vat_objective(logits, dist, valid, LossSwitches(**sw), vh_logits=vh, affinity=affinity,
                                      anchor_routing=routing, union_anchors=torch.tensor([0, 3, 7, 11]))
        loss.backward()
        out.append((loss.detach(), metrics["loss_k_sum"], metrics["union_sim_sum"], metrics["tau_sim_sum"], x.grad))
    for ref, got in zip(*out):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_head_inside_the_chunks_holds_no_batch_sized_tensor():
    """A (2, 64, 15, 2048) block batch through a (2048, 32) head: materialised logits and autograd hold several
    batch-sized fp32 tensors; the head inside 16-anchor chunks holds one chunk's (1/8 of the batch) at a time, plus
    the hidden states' gradient."""
    gen = torch.Generator().manual_seed(9)
    B, N, K, H, V = 2, 64, 15, 32, 2048
    weight = torch.randn(V, H, generator=gen) * 0.2
    dist = target_dist(torch.randn(B, N * K, V, generator=gen)).apply(lambda x: x.reshape(B, N, K, *x.shape[2:]))
    valid = torch.ones(B, N, K, dtype=torch.bool)
    batch_sized = B * N * K * V * 4

    def peak(lazy):
        x = torch.randn(B, N, K, H, generator=gen).requires_grad_(True)
        with PeakTensorBytes() as held:
            if lazy:
                loss = chunked_imitation(HeadLogits(x, weight), dist.probs, dist.argmax_draft, valid, 1.0, 1.0, 16)
            else:
                loss = _reference(x @ weight.T, dist.probs, dist.argmax_draft, valid, 1.0, 1.0)
            loss.sum().backward()
        return held.peak / batch_sized

    lazy, reference = peak(True), peak(False)
    assert reference > 3.0, reference
    assert lazy < 0.5, lazy  # at most a few chunk-sized (1/8) tensors at once: logits, softmax, gradient
