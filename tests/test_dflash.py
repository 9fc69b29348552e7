"""DFlash block drafter: the batched multi-anchor training forward against a per-anchor loop, what a block may not
see, the cached inference path against the training forward, anchor sampling and the default target layers."""

from __future__ import annotations

import pytest
import torch
from helpers import aux_batch

from vat.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    block_reference_forward,
    default_target_layer_ids,
    sample_block_anchors,
)
from vat.errors import VatError

HIDDEN, VOCAB, LAYERS = 64, 128, 4


pytestmark = pytest.mark.usefixtures("one_thread")


def make_draft(*, vh: bool = False, block_size: int = 4, layers: int = 2, seed: int = 0) -> DFlashDrafter:
    """A random 2-layer draft over random frozen target tables (GQA 4 heads / 2 KV heads)."""
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
        vocab_size=VOCAB, num_target_layers=LAYERS, block_size=block_size, mask_token_id=5, verification_head=vh,
        rope_theta=10000.0,
    )
    draft = DFlashDrafter(cfg, torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN) * 0.2)
    if vh:
        with torch.no_grad():
            draft.verification_head.weight.normal_()  # a head that reads its input, so its outputs are compared
    return draft.eval()


def inputs(B: int = 2, T: int = 20, seed: int = 1):
    return aux_batch(B, T, seed, features=2 * HIDDEN, vocab=VOCAB, low=6)


def test_default_target_layers_spread_from_1_to_L_minus_3():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-4B / 8B DFlash
    assert default_target_layer_ids(64, 10) == [1, 8, 14, 21, 28, 34, 41, 48, 54, 61]  # Qwen3-32B DFlash release
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(8, 2) == [1, 5]
    assert DFlashConfig(num_target_layers=36, num_hidden_layers=5, mask_token_id=1).target_layer_ids == [1, 9, 17, 25, 33]
    with pytest.raises(VatError, match="mask_token_id"):
        DFlashConfig(vocab_size=10, mask_token_id=10)


def test_batched_multi_anchor_forward_equals_per_anchor_reference():
    draft = make_draft(vh=True)
    aux, ids = inputs()
    anchors = torch.tensor([[1, 4, 5, 12, 16], [3, 9, 15, -1, -1]])  # adjacent, overlapping blocks and padding
    out = draft(aux, ids, anchors)
    ref = block_reference_forward(draft, aux, ids, anchors)
    assert out.logits.shape == (2, 5, 3, VOCAB) and out.vh_logits.shape == (2, 5, 3)
    real = anchors >= 0
    torch.testing.assert_close(out.logits[real], ref.logits[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden[real], ref.hidden[real], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.vh_logits[real], ref.vh_logits[real], atol=1e-5, rtol=1e-4)
    assert torch.isfinite(out.logits).all()  # padding blocks see only themselves: finite, ignored


def test_a_block_sees_only_context_before_its_anchor_and_never_another_block():
    draft = make_draft()
    aux, ids = inputs()
    attention = torch.ones(2, 20, dtype=torch.long)
    attention[1, 17:] = 0  # a right-padded row
    anchors = torch.tensor([[4, 5, 11], [2, 8, 13]])
    base = draft(aux, ids, anchors, attention).logits
    g = torch.Generator().manual_seed(7)
    for b, n in ((0, 0), (0, 1), (0, 2), (1, 1)):
        a = int(anchors[b, n])
        later = aux.clone()
        later[b, a:] += torch.randn(later[b, a:].shape, generator=g)  # the anchor's own and later context
        others = ids.clone()
        for m in range(anchors.shape[1]):  # the anchor tokens of every other block, every token of the other row
            if m != n:
                others[b, anchors[b, m]] = (others[b, anchors[b, m]] + 17) % VOCAB
        others[1 - b] = torch.randint(6, VOCAB, (20,), generator=g)
        others[b, a + 1 :] = (others[b, a + 1 :] + 3) % VOCAB  # the block's own data tokens after the anchor
        changed = draft(later, others, anchors, attention).logits
        torch.testing.assert_close(changed[b, n], base[b, n], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(changed[b, n - 1 if n else n + 1], base[b, n - 1 if n else n + 1], atol=1e-3)
    earlier = aux.clone()
    earlier[0, 3] += 1.0  # context before anchors 4 and 5 of row 0: those blocks must move (the test can fail)
    moved = draft(earlier, ids, anchors, attention).logits
    assert not torch.allclose(moved[0, 0], base[0, 0], atol=1e-3) and not torch.allclose(moved[0, 1], base[0, 1], atol=1e-3)
    padded = aux.clone()
    padded[1, 17:] += 5.0  # padding positions are never context
    torch.testing.assert_close(draft(padded, ids, anchors, attention).logits[1], base[1], atol=1e-5, rtol=1e-5)


def test_cached_block_drafting_equals_the_training_forward():
    draft = make_draft(vh=True)
    aux, ids = inputs(B=1, T=18)
    anchors = torch.tensor([[6, 13]])
    trained = draft(aux, ids, anchors)
    for n, a in enumerate(anchors[0].tolist()):
        cache = draft.new_cache(1)
        draft.extend_context(cache, aux[:, :2])  # the prefill, then rounds of accepted positions
        draft.extend_context(cache, aux[:, 2:a])
        assert cache.length == a
        out = draft.draft_block(cache, ids[:, a])
        assert cache.length == a  # drafting leaves the context untouched
        torch.testing.assert_close(out.logits[0, 0], trained.logits[0, n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.vh_logits[0, 0], trained.vh_logits[0, n], atol=1e-5, rtol=1e-4)


def test_sample_block_anchors_picks_distinct_eligible_positions():
    T, block = 30, 4
    loss = torch.zeros(3, T, dtype=torch.long)
    loss[0, 10:25] = 1
    loss[1, 5:8] = 1
    attention = torch.ones(3, T, dtype=torch.long)
    attention[1, 7:] = 0
    loss[2, 0] = 1  # position 0 has no context: never an anchor
    anchors = sample_block_anchors(loss, attention, block, 8, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 8)
    row0 = anchors[0].tolist()
    assert row0 == sorted(set(row0)) and all(10 <= a <= T - block for a in row0)
    assert anchors[1].tolist() == [5, 6] + [-1] * 6 and anchors[2].tolist() == [-1] * 8
    again = sample_block_anchors(loss, attention, block, 8, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    every = sample_block_anchors(loss, attention, block, 100, torch.Generator().manual_seed(1))
    assert every[0][every[0] >= 0].tolist() == list(range(10, 25)) and every.shape[1] == 15
