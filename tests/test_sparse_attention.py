"""The blockwise training attention (shared masked keys + keys private to each query group) against dense SDPA.

The reference is one SDPA call over the concatenated keys with a dense mask built key by key from the definition
(query i sees shared key j where the shared mask says so, and private key p of group g iff i is in group g); the
drafters' forwards are checked both ways: blockwise against dense, in outputs and in gradients.
"""

from __future__ import annotations

import pytest
import torch
from helpers import eagle3_batch, eagle3_config, random_eagle3

from vat.drafters.common import masked_attention
from vat.drafters.dflash import DFlashConfig, DFlashDrafter
from vat.drafters.sparse_attention import attention_with_private_keys, resolve_attention_impl

pytestmark = pytest.mark.usefixtures("one_thread")


def dense_reference(q, k_shared, v_shared, shared_mask, k_private, v_private, private_mask):
    """SDPA over [shared keys ; every group's private keys] with the mask written out entry by entry."""
    B, _, Q, _ = q.shape
    S, N, P = k_shared.shape[2], k_private.shape[2], k_private.shape[3]
    R = Q // N
    mask = torch.zeros(B, 1, Q, S + N * P, dtype=torch.bool)
    for b in range(B):
        for i in range(Q):
            mask[b, 0, i, :S] = shared_mask[min(b, shared_mask.shape[0] - 1), 0, i]
            g = i // R
            for p in range(P):
                mask[b, 0, i, S + g * P + p] = True if private_mask is None else private_mask[b, 0, i, p]
    keys = torch.cat([k_shared, k_private.flatten(2, 3)], dim=2)  # (B, Hkv, S + N P, D)
    values = torch.cat([v_shared, v_private.flatten(2, 3)], dim=2)
    return masked_attention(q, keys, values, mask)


@pytest.mark.parametrize("R,P,with_private_mask,shared_batch", [(1, 3, False, 2), (4, 4, True, 2), (2, 5, False, 1)])
def test_blockwise_attention_equals_dense_sdpa_outputs_and_gradients(R, P, with_private_mask, shared_batch):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, S, N = 2, 4, 2, 8, 9, 5
    Q = N * R
    q = torch.randn(B, H, Q, D, generator=g, requires_grad=True)
    ks = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    vs = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    kp = torch.randn(B, Hkv, N, P, D, generator=g, requires_grad=True)
    vp = torch.randn(B, Hkv, N, P, D, generator=g, requires_grad=True)
    shared_mask = torch.rand(shared_batch, 1, Q, S, generator=g) < 0.5
    shared_mask[..., 0, :] = False  # a query that sees no shared key at all (only its private ones)
    private_mask = None
    if with_private_mask:
        private_mask = torch.rand(B, 1, Q, P, generator=g) < 0.6
        private_mask[..., 0] = True  # every query keeps at least one key
    out = attention_with_private_keys(q, ks, vs, shared_mask, kp, vp, private_mask)
    ref = dense_reference(q, ks, vs, shared_mask, kp, vp, private_mask)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grad_out = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, ks, vs, kp, vp), grad_out)
    want = torch.autograd.grad(ref, (q, ks, vs, kp, vp), grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [0.01, 8.0, 40.0])
def test_blockwise_attention_is_exact_at_any_score_scale(scale):
    """The shared part's log-sum-exp is read out of SDPA through an extra key: exact whether the private keys
    dominate, are negligible, or scores run into the hundreds (where e^score overflows fp32)."""
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, D, S, N = 1, 4, 2, 16, 12, 6
    q = (torch.randn(B, H, N, D, generator=g) * scale).requires_grad_()
    ks, vs = torch.randn(2, B, Hkv, S, D, generator=g)
    kp, vp = torch.randn(2, B, Hkv, N, 3, D, generator=g)
    mask = torch.ones(1, 1, N, S, dtype=torch.bool).tril(diagonal=S - N)
    out = attention_with_private_keys(q, ks, vs, mask, kp, vp)
    ref = dense_reference(q, ks, vs, mask, kp, vp, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    grad_out = torch.randn(out.shape, generator=g)
    (a,), (b,) = torch.autograd.grad(out, (q,), grad_out), torch.autograd.grad(ref, (q,), grad_out)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_blockwise_attention_in_bf16_stays_close_to_fp32():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 6, 16, generator=g)
    ks, vs = torch.randn(2, 1, 2, 7, 16, generator=g)
    kp, vp = torch.randn(2, 1, 2, 3, 2, 16, generator=g)
    mask = torch.ones(1, 1, 6, 7, dtype=torch.bool).tril()
    ref = attention_with_private_keys(q, ks, vs, mask, kp, vp)
    low = attention_with_private_keys(*(t.bfloat16() for t in (q, ks, vs)), mask, kp.bfloat16(), vp.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)


def test_auto_is_blockwise_on_cpu_and_unknown_names_are_refused():
    assert resolve_attention_impl("auto", torch.device("cpu")) == "blockwise"
    assert resolve_attention_impl("auto", torch.device("meta")) == "dense"
    assert resolve_attention_impl("dense", torch.device("cpu")) == "dense"
    with pytest.raises(ValueError, match="blockwise"):
        resolve_attention_impl("flash", torch.device("cpu"))


def _grads(model, out, weights):
    """Gradients of every trainable parameter of a weighted sum of the logits and the VH logits."""
    loss = (out.logits * weights).sum() + (0 if out.vh_logits is None else out.vh_logits.sum())
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))]


def assert_same_outputs_and_gradients(model, got, want, weights, real=None, grad_atol=5e-5):
    """Two runs of one model's training forward: equal outputs (at ``real`` rows when given) and parameter gradients
    of the same weighted loss (which must not all vanish)."""
    for name in ("logits", "hidden", "vh_logits"):
        if getattr(want, name) is not None:
            a, b = getattr(got, name), getattr(want, name)
            torch.testing.assert_close(a if real is None else a[real], b if real is None else b[real], atol=1e-5,
                                       rtol=1e-5)
    expected = _grads(model, want, weights)
    assert any(g.abs().sum() > 0 for g in expected)
    for a, b in zip(_grads(model, got, weights), expected):
        torch.testing.assert_close(a, b, atol=grad_atol, rtol=1e-4)


def small_dflash(device="cpu"):
    """A random 2-layer DFlash draft (GQA 4 / 2 heads, block 4) and a batch: padded rows, overlapping and padding
    blocks, a block whose visible context starts with left padding."""
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=64, num_target_layers=4, block_size=4, mask_token_id=5,
                       verification_head=True, rope_theta=10000.0)
    draft = DFlashDrafter(cfg, torch.randn(64, 32), torch.randn(64, 32) * 0.2).to(device)
    g = torch.Generator().manual_seed(2)
    aux = torch.randn(2, 18, len(cfg.target_layer_ids) * 32, generator=g)
    ids = torch.randint(6, 64, (2, 18), generator=g)
    attention = torch.ones(2, 18, dtype=torch.long)
    attention[1, 15:] = 0
    attention[0, :2] = 0  # left padding: padded context keys before an anchor are never seen
    anchors = torch.tensor([[2, 4, 5, 12], [3, 9, -1, -1]])
    return draft, [t.to(device) for t in (aux, ids, anchors, attention)]


@pytest.mark.parametrize(
    "flags",
    [dict(verification_head=True), dict(num_key_value_heads=4, sliding_window=4, norm_output=True)],
    ids=["vh", "mha_window"],
)
def test_eagle3_ttt_blockwise_equals_dense_outputs_and_gradients(flags):
    model = random_eagle3(eagle3_config(ttt_steps=4, **flags))
    aux, ids = eagle3_batch(B=3, T=11)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    runs = {impl: model.ttt_forward(aux, ids, mask, attention=impl) for impl in ("dense", "blockwise")}
    weights = torch.randn(runs["dense"].logits.shape, generator=torch.Generator().manual_seed(3))
    assert_same_outputs_and_gradients(model, runs["blockwise"], runs["dense"], weights)


def test_dflash_blockwise_equals_dense_outputs_and_gradients():
    draft, (aux, ids, anchors, attention) = small_dflash()
    runs = {impl: draft(aux, ids, anchors, attention, attention=impl) for impl in ("dense", "blockwise")}
    real = anchors >= 0
    weights = torch.randn(runs["dense"].logits.shape, generator=torch.Generator().manual_seed(4)) * real[:, :, None, None]
    assert_same_outputs_and_gradients(draft, runs["blockwise"], runs["dense"], weights, real)


def test_flex_forward_equals_dense_for_both_drafters():
    """flex_attention's block masks written from the same rule: on CPU torch runs flex eagerly and forward only
    (its backward is CUDA; the GPU check compares gradients there)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = random_eagle3(eagle3_config(ttt_steps=4, sliding_window=5, verification_head=True))
    aux, ids = eagle3_batch(B=3, T=11)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, :3] = 0
    with torch.no_grad():
        dense = model.ttt_forward(aux, ids, mask, attention="dense")
        flex = model.ttt_forward(aux, ids, mask, attention="flex")
    torch.testing.assert_close(flex.logits, dense.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex.vh_logits, dense.vh_logits, atol=1e-5, rtol=1e-5)

    draft, (aux, ids, anchors, attention) = small_dflash()
    with torch.no_grad():
        dense = draft(aux, ids, anchors, attention, attention="dense")
        flex = draft(aux, ids, anchors, attention, attention="flex")
    real = anchors >= 0
    torch.testing.assert_close(flex.logits[real], dense.logits[real], atol=1e-5, rtol=1e-5)


def test_drafter_attention_is_a_recipe_key_checked_at_load():
    from vat.config import load_config
    from vat.errors import VatError

    assert load_config("tiny/eagle3_vat.yaml", ["drafter.attention=dense"]).drafter.attention == "dense"
    with pytest.raises(VatError, match="drafter.attention"):
        load_config("tiny/eagle3_vat.yaml", ["drafter.attention=flash"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_equals_dense_in_outputs_and_gradients_on_cuda():
    """The compiled flex path (what `drafter.attention: flex` runs on a GPU) against dense SDPA, fp32, both drafters,
    at a size where the block masks skip whole blocks (T = 320: 128-wide blocks, chain keys off the diagonal)."""
    dev = torch.device("cuda")
    model = random_eagle3(eagle3_config(ttt_steps=4, verification_head=True)).to(dev).train()
    aux, ids = (t.to(dev) for t in eagle3_batch(B=2, T=320))
    mask = torch.ones(2, 320, dtype=torch.long, device=dev)
    mask[1, 300:] = 0
    weights = torch.randn(2, 320, 4, model.config.draft_vocab_size, device=dev)
    runs = {impl: model.ttt_forward(aux, ids, mask, attention=impl) for impl in ("dense", "flex")}
    torch.testing.assert_close(runs["flex"].logits, runs["dense"].logits, atol=2e-4, rtol=2e-4)
    for a, b in zip(_grads(model, runs["flex"], weights), _grads(model, runs["dense"], weights)):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)

    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=128, num_target_layers=4, block_size=8, mask_token_id=5,
                       rope_theta=10000.0)
    # the frozen embedding and LM head are unregistered (`.to` leaves them): build them on the device, as the trainer
    # attaches the target's own
    draft = DFlashDrafter(cfg, torch.randn(128, 64, device=dev), torch.randn(128, 64, device=dev) * 0.2).to(dev).train()
    aux = torch.randn(2, 320, len(cfg.target_layer_ids) * 64, device=dev)
    ids = torch.randint(6, 128, (2, 320), device=dev)
    anchors = torch.sort(torch.randperm(300, device=dev)[:40] + 1).values.expand(2, 40).contiguous()
    runs = {impl: draft(aux, ids, anchors, mask, attention=impl) for impl in ("dense", "flex")}
    torch.testing.assert_close(runs["flex"].logits, runs["dense"].logits, atol=2e-4, rtol=2e-4)
    weights = torch.randn(runs["dense"].logits.shape, device=dev)
    for a, b in zip(_grads(draft, runs["flex"], weights), _grads(draft, runs["dense"], weights)):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
