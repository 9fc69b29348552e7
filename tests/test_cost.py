"""The roofline cost model (vat/eval/cost.py) against hand computations."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from vat.errors import VatError
from vat.eval.cost import (
    ACCELERATORS,
    Accelerator,
    CostModel,
    ModelShape,
    attention_terms,
    draft_forwards,
    forward_cost,
    get_accelerator,
    roofline_seconds,
    target_shape,
)
from vat.eval.engine import Generation, RoundStats

SHAPE = ModelShape(dense_params=1000, dense_matmul_params=1000, expert_params=[100, 200], top_k=2, kv_per_token=8,
                   attn_flops_per_key=16)


def test_forward_cost_is_the_hand_computation():
    # T = 3 tokens over 5 cached positions, unions U = (3, 4), bf16 (2 bytes):
    #   bytes = (dense 1000 + 3*100 + 4*200) * 2 + (5 + 3) keys * 8 elements * 2 = 2100*2 + 128 = 4328
    #   FLOPs = 3 * (2*1000 + 2*k=2*(100 + 200)) + 3 tokens * 8 keys * 16 = 3 * 3200 + 384 = 9984
    nbytes, flops = forward_cost(SHAPE, tokens=3, context=5, union=[3, 4], served_bytes=2)
    assert nbytes == 4328 and flops == 9984
    h200 = get_accelerator("H200")
    assert h200.hbm_bytes_per_s == 4.8e12 and h200.bf16_flops_per_s == 989.5e12
    # memory bound: 4328 / 4.8e12 = 9.0167e-10 s > 9984 / 989.5e12 = 1.009e-11 s
    assert roofline_seconds(h200, nbytes, flops) == pytest.approx(4328 / 4.8e12)
    # a made-up accelerator with 1 FLOP/s per byte/s of bandwidth: compute bound, 9984 s
    slow = Accelerator("x", "x", 1.0, 1.0, "test")
    assert roofline_seconds(slow, nbytes, flops) == 9984


def test_generation_sums_draft_and_verify_rounds_and_models_ar_on_the_same_tokens():
    acc = Accelerator("x", "x", 1.0, 1e30, "bandwidth only")  # seconds = bytes
    model = CostModel(acc, SHAPE, served_bytes=1)
    draft = ModelShape(dense_params=50, dense_matmul_params=50, expert_params=[], top_k=0, kv_per_token=1,
                       attn_flops_per_key=0)
    # prompt of 10; round 1 drafts 3 (chain depth 3), accepts 2 -> 3 tokens; round 2 drafts 3, accepts 0 -> 1 token
    rounds = [RoundStats(drafted=3, depth=3, accepted=2, reached=3, committed=3, union=[5, 6]),
              RoundStats(drafted=3, depth=3, accepted=0, reached=1, committed=1, union=[4, 4])]
    gen = Generation(token_ids=list(range(5)), rounds=rounds, target_forwards=3, seconds=1.0, prompt_tokens=10)
    out = model.generation(gen, "chain", draft)
    # chain drafting runs 1 + (depth - 1) = 3 draft forwards of one position each: 50 + (ctx + 1) * 1 bytes each
    draft1 = 3 * (50 + 11)  # context 10
    verify1 = 1000 + 5 * 100 + 6 * 200 + (10 + 4) * 8  # 4 tokens over 10: 2700 + 112
    draft2 = 3 * (50 + 14)  # context 10 + 3
    verify2 = 1000 + 4 * 100 + 4 * 200 + (13 + 4) * 8  # 2200 + 136
    assert out["modeled_draft_seconds"] == draft1 + draft2
    assert out["modeled_seconds"] == draft1 + verify1 + draft2 + verify2
    # AR: 4 steps (5 tokens, the first from the prefill), each 1 token with U = k = 2 per layer, at contexts 10..13
    ar = sum(1000 + 2 * 100 + 2 * 200 + (c + 1) * 8 for c in range(10, 14))
    assert out["modeled_ar_seconds"] == ar
    # a round EVICT cut from depth 3 to depth 1 still ran its 3 draft forwards
    cut = Generation(token_ids=[0, 1], rounds=[RoundStats(drafted=1, depth=1, accepted=0, reached=1, committed=1,
                                                         union=[5, 6], drafted_depth=3)],
                     target_forwards=2, seconds=1.0, prompt_tokens=10)
    assert model.generation(cut, "chain", draft)["modeled_draft_seconds"] == draft1
    assert draft_forwards("tree", 4, top_k=3) == [1, 3, 3, 3]
    assert draft_forwards("block", 7) == [8] and draft_forwards("ngram", 5) == [] and draft_forwards("ar", 0) == []


def test_target_shape_of_a_tiny_olmoe_is_counted_by_hand():
    from vat.target import load_target

    target = load_target(tiny_model("olmoe"), device="cpu")
    shape = target_shape(target)
    # per layer: q 64*64, k 32*64, v 32*64, o 64*64, q_norm 64, k_norm 32, router 8*64, two norms 2*64
    layer = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 64 + 32 + 8 * 64 + 2 * 64
    dense = 2 * layer + 64 + 128 * 64  # + final norm + untied LM head (the input embedding reads T rows only)
    assert shape.dense_params == dense
    assert shape.expert_params == [64 * 64 + 64 * 32] * 2  # one expert: gate_up (2f x d) + down (d x f), f = 32
    assert shape.top_k == 2
    assert shape.kv_per_token == 2 * 2 * 2 * 16  # K and V, 2 layers, 2 KV heads of 16
    assert shape.attn_flops_per_key == 4 * 2 * 4 * 16  # QK and AV (2 FLOPs each), 2 layers, 4 heads of 16
    # the expert bytes the eval counts (fp32 here) are the same experts
    assert [e * 4 for e in shape.expert_params] == target.expert_bytes_per_layer()
    target.close()


def test_unknown_accelerator_lists_the_known_ones():
    with pytest.raises(VatError, match="unknown cost model `b200`: known accelerators are h100, h200, a100, l40s"):
        get_accelerator("b200")
    assert set(ACCELERATORS) == {"h100", "h200", "a100", "l40s"}


def test_the_presets_are_the_pure_bytes_model():
    h200 = get_accelerator("h200")
    assert h200.eta == 1.0 and h200.latency_us == 0.0 and h200.pure_bytes and h200.name == "h200"
    # 4328 bytes, 9984 FLOPs (test_forward_cost_is_the_hand_computation): bytes / 4.8e12, nothing added
    assert roofline_seconds(h200, 4328, 9984) == 4328 / 4.8e12


def test_eta_and_latency_price_a_forward_by_hand():
    acc = get_accelerator("H200@eta=0.5,latency_us=3")
    assert acc.name == "h200@eta=0.5,latency_us=3" and acc.eta == 0.5 and acc.latency_us == 3.0
    assert acc.hbm_bytes_per_s == 4.8e12 and not acc.pure_bytes
    # 4.8e6 bytes at half of 4.8 TB/s = 2 µs, plus 3 µs fixed = 5 µs (FLOPs 1 µs: memory bound)
    assert roofline_seconds(acc, 4.8e6, 989.5e6) == pytest.approx(5e-6, rel=1e-12)
    # compute bound: 9.895e9 FLOPs = 10 µs > 4.8e6 bytes at η 0.5 = 2 µs; + 3 µs
    assert roofline_seconds(acc, 4.8e6, 9.895e9) == pytest.approx(13e-6, rel=1e-12)
    # a bare knob takes the documented default (η 0.8, 10 µs); an unnamed knob keeps the pure value
    assert get_accelerator("h100@eta").name == "h100@eta=0.8,latency_us=0"
    assert get_accelerator("h100@latency_us").name == "h100@eta=1,latency_us=10"
    assert get_accelerator("h100@eta,latency_us").name == "h100@eta=0.8,latency_us=10"


def test_latency_is_paid_by_every_forward_ar_and_draft_alike():
    lat = Accelerator("x", "x", 1.0, 1e30, "bandwidth only", latency_us=1e6)  # seconds = bytes + 1 per forward
    model = CostModel(lat, SHAPE, served_bytes=1)
    plain = CostModel(Accelerator("x", "x", 1.0, 1e30, "bandwidth only"), SHAPE, served_bytes=1)
    draft = ModelShape(dense_params=50, dense_matmul_params=50, expert_params=[], top_k=0, kv_per_token=1,
                       attn_flops_per_key=0)
    rounds = [RoundStats(drafted=3, depth=3, accepted=2, reached=3, committed=3, union=[5, 6])]
    gen = Generation(token_ids=list(range(4)), rounds=rounds, target_forwards=2, seconds=1.0, prompt_tokens=10)
    with_lat, without = model.generation(gen, "chain", draft), plain.generation(gen, "chain", draft)
    # the round: 3 draft forwards + 1 verification = 4 forwards; AR: 3 steps = 3 forwards
    assert with_lat["modeled_seconds"] == pytest.approx(without["modeled_seconds"] + 4)
    assert with_lat["modeled_draft_seconds"] == pytest.approx(without["modeled_draft_seconds"] + 3)
    assert with_lat["modeled_ar_seconds"] == pytest.approx(without["modeled_ar_seconds"] + 3)


@pytest.mark.parametrize("spec,message", [
    ("h200@eta=0", "cost model `h200@eta=0`: eta must be in (0, 1], got 0"),
    ("h200@eta=1.5", "cost model `h200@eta=1.5`: eta must be in (0, 1], got 1.5"),
    ("h200@latency_us=-1", "cost model `h200@latency_us=-1`: latency_us must be >= 0, got -1"),
    ("h200@eta=fast", "cost model `h200@eta=fast`: `eta` takes a number, got `fast`"),
    ("h200@bw=2", "cost model `h200@bw=2`: unknown knob `bw`"),
    ("h200@eta=0.5,eta=0.6", "cost model `h200@eta=0.5,eta=0.6`: repeated knob `eta`"),
    ("b200@eta=0.5", "unknown cost model `b200@eta=0.5`: known accelerators are h100"),
])
def test_bad_knobs_are_one_line(spec, message):
    with pytest.raises(VatError) as err:
        get_accelerator(spec)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_mla_caches_the_latent_as_deepseek_v3s_config_defines_it():
    from transformers import DeepseekV3Config

    config = DeepseekV3Config()  # transformers' defaults are DeepSeek-V3's own: 61 layers, 128 heads, MLA 512 + 64
    terms = attention_terms(config)
    per_layer = config.kv_lora_rank + config.qk_rope_head_dim
    assert per_layer == 576
    assert terms["kv_per_token"] == config.num_hidden_layers * 576  # not 2 * 128 heads * 64 = 16,384 per layer
    heads = config.num_attention_heads
    assert terms["attn_flops_per_key"] == config.num_hidden_layers * (2 * heads * 576 + 2 * heads * 512)
    assert terms["window"] == terms["window_kv_per_token"] == 0


def test_sliding_window_layers_read_at_most_their_window():
    from transformers import GptOssConfig

    config = GptOssConfig()  # GPT-OSS: sliding (W = 128) and full attention alternate
    terms = attention_terms(config)
    kinds = config.layer_types[: config.num_hidden_layers]
    per_layer = 2 * config.num_key_value_heads * config.head_dim
    assert terms["window"] == 128
    assert terms["window_kv_per_token"] == kinds.count("sliding_attention") * per_layer
    assert terms["kv_per_token"] == kinds.count("full_attention") * per_layer
    shape = ModelShape(dense_params=0, dense_matmul_params=0, expert_params=[], top_k=0, **terms)
    # 4 tokens over 10,000 cached positions: the full layers read 10,004 keys, the windowed ones 128 + 4
    nbytes, flops = forward_cost(shape, tokens=4, context=10_000, union=None, served_bytes=2)
    assert nbytes == 2 * (10_004 * terms["kv_per_token"] + 132 * terms["window_kv_per_token"])
    assert flops == 4 * (10_004 * terms["attn_flops_per_key"] + 132 * terms["window_attn_flops_per_key"])
    # early in a decode (context below the window) both kinds read every key
    nbytes, _ = forward_cost(shape, tokens=4, context=50, union=None, served_bytes=2)
    assert nbytes == 2 * 54 * (terms["kv_per_token"] + terms["window_kv_per_token"])


def test_a_shape_recorded_before_the_windowed_terms_still_loads():
    old = {k: v for k, v in SHAPE.to_dict().items() if not k.startswith("window")}
    assert ModelShape.from_dict(old) == SHAPE
