"""EAGLE-3 draft head: TTT forward vs a per-position reference, mask/recurrence properties, KV-cache drafting vs TTT,
draft-vocab helpers, config and target validation. Tiny dims (hidden 64, 4 heads, vocab 128, draft vocab 64)."""

from __future__ import annotations

import pytest
import torch
from helpers import HT, VD, H, V, eagle3_batch, eagle3_config, eagle3_vocab_mapping, random_eagle3
from safetensors.torch import save_file

from vat.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    check_draft_matches_target,
    default_aux_layer_ids,
    draft_vocab_position_mask,
    identity_vocab_mapping,
    in_draft_vocab,
    load_vocab_mapping,
    map_draft_probs_to_target,
    map_draft_to_target,
    shift_for_ttt,
    target_probs_on_draft_vocab,
    ttt_reference_forward,
    ttt_valid_mask,
    validate_vocab_mapping,
)
from vat.errors import VatError

FLAGS = [
    dict(),
    dict(norm_before_residual=True, fc_norm=True, verification_head=True),
    dict(norm_before_fc=True, verification_head=True, num_key_value_heads=4),
    dict(verification_head=True, vh_input="prenorm"),
    dict(norm_output=True, norm_before_residual=True, norm_before_fc=True, verification_head=True, sliding_window=4),
]


# ----------------------------------------------------------------------------------------------------------------------
# TTT forward
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", FLAGS, ids=["default", "nbr_fcnorm_vh", "nbfc_mha_vh", "vh_prenorm", "normout_swa"])
def test_ttt_forward_matches_per_position_reference_with_padding(flags):
    cfg = eagle3_config(**flags)
    model = random_eagle3(cfg)
    aux, ids = eagle3_batch(B=3, T=10)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, 7:] = 0  # right padding
    mask[1, 2] = 0  # a hole inside the prefix
    mask[2, :3] = 0  # left padding: padded queries must stay finite
    with torch.no_grad():
        out = model.ttt_forward(aux, ids, mask)
    ref = ttt_reference_forward(model, aux, ids, mask)
    assert out.logits.shape == (3, 10, 3, VD)
    assert out.hidden.shape == (3, 10, 3, H)
    assert torch.isfinite(out.logits).all()
    for k in range(3):
        torch.testing.assert_close(out.logits[:, :, k], ref.logits[:, :, k], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.hidden[:, :, k], ref.hidden[:, :, k], atol=1e-5, rtol=1e-5)
    if cfg.verification_head:
        assert out.vh_logits.shape == (3, 10, 3)
        torch.testing.assert_close(out.vh_logits, ref.vh_logits, atol=1e-5, rtol=0)
    else:
        assert out.vh_logits is None and ref.vh_logits is None


def test_ttt_step_sees_only_its_prefix_and_teacher_forced_tokens():
    """logits[:, t, k] depends on aux_{<=t} and tokens_{<=t+1+k} only, and ignores padded keys."""
    model = random_eagle3(eagle3_config(ttt_steps=4))
    aux, ids = eagle3_batch(B=1, T=12)
    t = 5
    with torch.no_grad():
        base = model.ttt_forward(aux, ids).logits
        for k in range(4):
            aux2, ids2 = aux.clone(), ids.clone()
            aux2[:, t + 1 :] += 3.0
            ids2[:, t + 2 + k :] = (ids2[:, t + 2 + k :] + 1) % V
            out = model.ttt_forward(aux2, ids2).logits
            torch.testing.assert_close(out[:, t, k], base[:, t, k], atol=1e-6, rtol=0)
            # the token consumed at step k does matter
            ids3 = ids.clone()
            ids3[:, t + 1 + k] = (ids3[:, t + 1 + k] + 1) % V
            assert (model.ttt_forward(aux, ids3).logits[:, t, k] - base[:, t, k]).abs().max() > 1e-4
        # a padded key at s = 2 is invisible to every later anchor
        mask = torch.ones(1, 12, dtype=torch.long)
        mask[0, 2] = 0
        masked = model.ttt_forward(aux, ids, mask).logits
        aux4 = aux.clone()
        aux4[:, 2] += 5.0
        torch.testing.assert_close(model.ttt_forward(aux4, ids, mask).logits[:, 3:], masked[:, 3:], atol=1e-6, rtol=0)
        assert (masked[:, 3:] - base[:, 3:]).abs().max() > 1e-4


def test_ttt_recurrence_feeds_prenorm_hidden():
    """Step k+1 is a function of the step-k pre-norm hidden: recomputing it by hand from out.hidden matches."""
    model = random_eagle3(eagle3_config(ttt_steps=2))
    aux, ids = eagle3_batch(B=1, T=4)
    with torch.no_grad():
        out = model.ttt_forward(aux, ids)
        t = 0  # anchor 0: only key (0,0) from the prefix and its own step-1 key
        # step 1 at anchor 0 via the inference path: cache with entry (aux_0, x_1), then hidden = out.hidden[0,0,0]
        cache = model.new_cache(1)
        model.step(cache, ids[:, 1:2], aux_hidden=aux[:, :1])
        step1 = model.step(cache, ids[:, 2:3], hidden=out.hidden[:, t, 0][:, None])
    torch.testing.assert_close(step1.logits[:, 0], out.logits[:, t, 1], atol=1e-5, rtol=0)


def test_ttt_backward_reaches_trainable_weights_not_embedding():
    model = random_eagle3(eagle3_config(verification_head=True)).train()
    aux, ids = eagle3_batch(B=1, T=6)
    out = model.ttt_forward(aux, ids)
    (out.logits.square().mean() + out.vh_logits.mean()).backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0
    assert model.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0
    assert model.verification_head.weight.grad.abs().sum() > 0
    assert not model.embed_tokens.weight.requires_grad
    assert all("embed" not in n for n, _ in model.named_parameters())
    assert all("embed" not in n for n in model.state_dict())
    # unregistered: no buffer either, and casting the draft leaves the (shared) target table alone
    weight = model.embed_tokens.weight
    assert all(b.data_ptr() != weight.data_ptr() for b in model.buffers())
    model.double()
    assert model.embed_tokens.weight is weight and weight.dtype == torch.float32
    assert model.ttt_forward(aux.double(), ids).logits.dtype == torch.float64


def test_forward_without_embedding_is_a_clear_error():
    model = Eagle3Drafter(eagle3_config())
    aux, ids = eagle3_batch(B=1, T=4)
    with pytest.raises(VatError, match="set_embedding"):
        model.ttt_forward(aux, ids)
    with pytest.raises(VatError, match="shape"):
        model.set_embedding(torch.zeros(V + 1, H))


# ----------------------------------------------------------------------------------------------------------------------
# KV-cache inference
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [*FLAGS[:2], dict(norm_output=True, verification_head=True), dict(sliding_window=16, norm_output=True)],
    ids=["default", "nbr_fcnorm_vh", "normout_vh", "wide_window"],
)
def test_draft_chain_matches_ttt_teacher_forced_on_drafted_tokens(flags):
    K = 4
    model = random_eagle3(eagle3_config(ttt_steps=K, **flags))
    aux, ids = eagle3_batch(B=2, T=14)
    n = 8  # prompt x_0..x_{n-1}, bonus x_n: anchor t = n - 1
    cache = model.new_cache(2)
    model.step(cache, ids[:, 1:4], aux_hidden=aux[:, :3])  # extend in two chunks
    draft = model.draft_chain(cache, aux[:, 3:n], ids[:, 4 : n + 1], K)
    assert draft.token_ids.shape == (2, K) and draft.probs.shape == (2, K, VD)
    assert cache.length == n  # speculative steps 1..K-1 cropped
    assert torch.equal(draft.token_ids, map_draft_to_target(draft.draft_token_ids, model.d2t))
    assert t2d_ok(draft.token_ids, model.t2d)
    forced = ids.clone()
    forced[:, n + 1 : n + K] = draft.token_ids[:, : K - 1]  # teacher-force what the chain drafted
    with torch.no_grad():
        ttt = model.ttt_forward(aux, forced, ttt_steps=K)
    for k in range(K):
        torch.testing.assert_close(draft.logits[:, k], ttt.logits[:, n - 1, k], atol=1e-5, rtol=0)
    assert torch.equal(draft.draft_token_ids, ttt.logits[:, n - 1].argmax(-1))
    if model.verification_head is not None:
        torch.testing.assert_close(draft.vh_probs, torch.sigmoid(ttt.vh_logits[:, n - 1]), atol=1e-5, rtol=0)


def t2d_ok(token_ids: torch.Tensor, t2d: torch.Tensor) -> bool:
    return bool(in_draft_vocab(token_ids, t2d).all())


def test_ragged_extend_equals_separate_rows_and_crop_restores_state():
    K = 3
    model = random_eagle3(eagle3_config(ttt_steps=K))
    aux, ids = eagle3_batch(B=2, T=12)
    lengths = [7, 4]
    # batched: one extend of 7 entries, row 1 padded after 4
    cache = model.new_cache(2)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, :7] = True
    mask[1, :4] = True
    together = model.draft_chain(cache, aux[:, :7], ids[:, 1:8], K, input_mask=mask, keep_chain_kv=True)
    assert cache.length == 7 + K - 1
    assert cache.next_positions().tolist() == [7 + K - 1, 4 + K - 1]
    cache.crop(7)
    assert cache.next_positions().tolist() == [7, 4]
    for row, n in enumerate(lengths):
        single = model.new_cache(1)
        alone = model.draft_chain(single, aux[row : row + 1, :n], ids[row : row + 1, 1 : n + 1], K)
        torch.testing.assert_close(together.logits[row], alone.logits[0], atol=1e-5, rtol=0)
    # the next round after crop continues both rows consistently with a fresh single-row run
    nxt = model.draft_chain(cache, aux[:, 7:8], ids[:, 8:9], K)
    single = model.new_cache(1)
    ref = model.draft_chain(single, aux[:1, :8], ids[:1, 1:9], K)
    torch.testing.assert_close(nxt.logits[0], ref.logits[0], atol=1e-5, rtol=0)


def test_sampled_chain_uses_tempered_distribution():
    model = random_eagle3(eagle3_config())
    aux, ids = eagle3_batch(B=2, T=6)
    gen = torch.Generator().manual_seed(0)
    draft = model.draft_chain(model.new_cache(2), aux, ids, 3, temperature=0.7, generator=gen)
    torch.testing.assert_close(draft.probs, torch.softmax(draft.logits / 0.7, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(2, 3))
    assert (draft.probs.gather(-1, draft.draft_token_ids[..., None]) > 0).all()


# ----------------------------------------------------------------------------------------------------------------------
# Draft-vocab and alignment helpers
# ----------------------------------------------------------------------------------------------------------------------


def test_vocab_helpers_against_brute_force(tmp_path):
    d2t, t2d = eagle3_vocab_mapping(3)
    used = torch.nonzero(t2d).flatten()
    draft_ids = torch.randint(0, VD, (4, 5))
    assert torch.equal(map_draft_to_target(draft_ids, d2t), used[draft_ids])
    logits = torch.randn(2, 3, V)
    p = torch.softmax(logits, -1)[..., used]
    torch.testing.assert_close(target_probs_on_draft_vocab(logits, t2d), p / p.sum(-1, keepdim=True))
    logits[0, 0, used[5]] = 50.0  # argmax in the draft vocab
    outside = int(torch.nonzero(~t2d)[0])
    logits[0, 1, outside] = 50.0  # argmax outside
    keep = draft_vocab_position_mask(logits, t2d)
    assert keep[0, 0] and not keep[0, 1]
    assert torch.equal(in_draft_vocab(torch.tensor([used[0], outside]), t2d), torch.tensor([True, False]))
    q = torch.softmax(torch.randn(3, VD), -1)
    full = map_draft_probs_to_target(q, d2t, V)
    assert full.shape == (3, V) and torch.equal(full[:, used], q) and (full[:, ~t2d] == 0).all()
    # the file written by `vat prep vocab`
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "vocab.safetensors"))
    d2t2, t2d2 = load_vocab_mapping(str(tmp_path / "vocab.safetensors"))
    assert torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d)
    d0, t0 = identity_vocab_mapping(V, VD)
    assert torch.equal(map_draft_to_target(torch.arange(VD), d0), torch.arange(VD)) and int(t0.sum()) == VD


def test_vocab_mapping_validation():
    d2t, t2d = eagle3_vocab_mapping(0)
    validate_vocab_mapping(d2t, t2d, V, VD)
    with pytest.raises(VatError, match="disagree"):
        validate_vocab_mapping(torch.zeros(VD, dtype=torch.long), t2d, V, VD)
    with pytest.raises(VatError, match="shape"):
        validate_vocab_mapping(d2t[:-1], t2d, V, VD)
    with pytest.raises(VatError, match="disagree"):
        random_eagle3(eagle3_config()).set_vocab_mapping(d2t, ~t2d & (torch.arange(V) < 2 * VD))


def test_shift_and_valid_mask_brute_force():
    B, T, K = 2, 7, 3
    x = torch.arange(B * T).view(B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 5:] = 0
    mask[1, 2] = 0
    shifted = shift_for_ttt(x, K, fill_value=-1)
    valid = ttt_valid_mask(mask, K)
    for b in range(B):
        for t in range(T):
            for k in range(K):
                i = t + 1 + k
                assert shifted[b, t, k] == (x[b, i] if i < T else -1)
                expect = i < T and bool(mask[b, t : i + 1].all())
                assert bool(valid[b, t, k]) == expect, (b, t, k)


# ----------------------------------------------------------------------------------------------------------------------
# Config and target validation
# ----------------------------------------------------------------------------------------------------------------------


def test_config_round_trip_and_errors():
    cfg = eagle3_config(norm_before_residual=True, verification_head=True, target_path="/t")
    assert Eagle3Config.from_dict(cfg.to_dict()) == cfg
    assert cfg.head_dim == 16 and eagle3_config(target_hidden_size=None).target_hidden_size == H
    with pytest.raises(VatError, match="did you mean 'draft_vocab_size'"):
        Eagle3Config.from_dict({**cfg.to_dict(), "draft_vocab_sz": 3})
    with pytest.raises(VatError, match="mutually exclusive"):
        eagle3_config(norm_before_fc=True, fc_norm=True)
    with pytest.raises(VatError, match="exactly 3"):
        eagle3_config(aux_layer_ids=[1, 2])
    with pytest.raises(VatError, match="multiple"):
        eagle3_config(num_key_value_heads=3)
    assert eagle3_config(aux_layer_ids=None, num_target_layers=32).aux_layer_ids == [1, 15, 28]
    assert default_aux_layer_ids(2) == [1, 0, 0]


def test_config_for_target_from_transformers_config():
    from tiny_models import tiny_config as tiny_target_config

    olmoe = tiny_target_config("olmoe", num_layers=8)
    cfg = Eagle3Config.for_target(olmoe, draft_vocab_size=VD)
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (64, 64, 128, VD)
    assert cfg.intermediate_size == 4 * 64  # OLMoE's intermediate_size is a per-expert width
    assert cfg.num_key_value_heads == olmoe.num_key_value_heads and cfg.num_target_layers == 8
    assert cfg.aux_layer_ids == [1, 3, 4]
    qwen = tiny_target_config("qwen3_moe")
    assert Eagle3Config.for_target(qwen, draft_vocab_size=VD).head_dim == 16


def test_check_draft_matches_target():
    cfg = eagle3_config(target_path="/targets/olmoe")
    assert check_draft_matches_target(cfg, HT, V, 8) == [1, 3, 4]
    cases = [
        ((H, V, 8), "hidden size 48, this target has 64"),
        ((HT, V + 2, 8), "vocab size 128, this target has 130"),
        ((HT, V, 6), "8 layers, this target has 6"),
    ]
    for args, msg in cases:
        with pytest.raises(VatError, match=msg) as err:
            check_draft_matches_target(cfg, *args)
        assert "\n" not in str(err.value) and "/targets/olmoe" in str(err.value)
    with pytest.raises(VatError, match=r"out of range for a 4-layer target: \[4\]"):
        check_draft_matches_target(eagle3_config(num_target_layers=None), HT, V, 4)
    unset = eagle3_config(aux_layer_ids=None, num_target_layers=None)
    assert check_draft_matches_target(unset, HT, V, 32) == [1, 15, 28]


def test_detached_verification_head_trains_the_head_only():
    """``loss.vh_detach``: the VH's BCE reaches the head's weights and nothing of the draft body."""
    import torch.nn.functional as F

    model = random_eagle3(eagle3_config(verification_head=True)).train()
    aux, ids = eagle3_batch()
    out = model.ttt_forward(aux, ids, ttt_steps=3)
    torch.testing.assert_close(model.verification_logits(out.hidden), out.vh_logits)
    for detach in (False, True):  # the trainer's path: the TTT forward with vh_detach
        model.zero_grad(set_to_none=True)
        vh = model.ttt_forward(aux, ids, ttt_steps=3, vh_detach=detach).vh_logits
        torch.testing.assert_close(vh, out.vh_logits)
        F.binary_cross_entropy_with_logits(vh, torch.ones_like(vh)).backward()
        assert model.verification_head.weight.grad.abs().sum() > 0
        body = model.fc.weight.grad
        assert (body is None) == detach, detach
    with pytest.raises(VatError, match="no verification head"):
        random_eagle3(eagle3_config()).verification_logits(out.hidden)


def test_verification_head_starts_at_the_prior_and_sends_no_gradient_into_the_body():
    """Zero weight, bias logit(0.2): v̂ = 0.2 everywhere, and its BCE moves only the head's own parameters."""
    import math

    import torch.nn.functional as F

    for vh_input in ("normed", "prenorm"):
        model = Eagle3Drafter(eagle3_config(verification_head=True, vh_input=vh_input), torch.randn(V, H)).train()
        assert model.verification_head.weight.abs().max() == 0
        assert model.verification_head.bias.item() == pytest.approx(math.log(0.2 / 0.8))
        aux, ids = eagle3_batch()
        vh = model.ttt_forward(aux, ids, ttt_steps=3).vh_logits
        torch.testing.assert_close(torch.sigmoid(vh), torch.full_like(vh, 0.2))
        F.binary_cross_entropy_with_logits(vh, torch.randint(0, 2, vh.shape).float()).backward()
        assert model.verification_head.weight.grad.abs().sum() > 0
        for name, p in model.named_parameters():
            if not name.startswith("verification_head."):
                assert p.grad is None or p.grad.abs().max() == 0, name


def test_verification_head_reads_what_the_lm_head_reads():
    model = random_eagle3(eagle3_config(verification_head=True))
    hidden = torch.randn(2, 5, H) * 7.0
    with torch.no_grad():
        expect = model.verification_head(model.norm(hidden)).squeeze(-1)
        torch.testing.assert_close(model.verification_logits(hidden), expect)
        # invariant to the residual's scale, unlike the pre-norm tap
        torch.testing.assert_close(model.verification_logits(hidden * 10), expect, atol=1e-4, rtol=1e-4)


def test_checkpoints_from_before_vh_input_load_as_prenorm():
    data = eagle3_config(verification_head=True).to_dict()
    assert data["vh_input"] == "normed"
    del data["vh_input"]  # a config.json written before the key existed
    assert Eagle3Config.from_dict(data).vh_input == "prenorm"
    with pytest.raises(VatError, match="vh_input"):
        eagle3_config(vh_input="residual")
