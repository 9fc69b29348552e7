"""benchmarks/step_profile.py's arithmetic: the analytic parameter count (by hand, against transformers' own models and
the published totals), the memory-model fit and the itemized prediction on hand-computed numbers, the header parse,
and the 2-layer stand-in builder (a shrunken shape that vat's ``load_target`` loads). No timing, no training step."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from vat.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _profile_module():
    path = os.path.join(REPO, "benchmarks", "step_profile.py")
    spec = importlib.util.spec_from_file_location("step_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sp = _profile_module()

# shrunken shapes of the three families (tiny hidden / vocab / experts), 2 layers
TINY = {
    "olmoe": dict(family="olmoe", hidden=8, layers=2, heads=2, kv_heads=2, head_dim=4, experts=4, top_k=2,
                  expert_intermediate=6, intermediate=6, vocab=16, norm_topk_prob=False, rope_theta=1e4,
                  max_positions=64, rms_norm_eps=1e-5),
    "qwen3_moe": dict(family="qwen3_moe", hidden=16, layers=2, heads=4, kv_heads=2, head_dim=8, experts=8, top_k=2,
                      expert_intermediate=12, intermediate=48, vocab=40, norm_topk_prob=True, rope_theta=1e6,
                      max_positions=64, rms_norm_eps=1e-6),
    "mixtral": dict(family="mixtral", hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4, experts=4, top_k=2,
                    expert_intermediate=24, intermediate=24, vocab=32, rope_theta=1e6, max_positions=64,
                    rms_norm_eps=1e-5),
}


def test_param_count_by_hand_for_a_tiny_olmoe():
    counts = sp.param_count(TINY["olmoe"])
    # per layer: q, k, v, o 4 x 8 x 8 = 256; q_norm over H = 8 and k_norm over H / heads x kv_heads = 8: 16;
    # router 4 x 8 = 32; experts 3 x 4 x 8 x 6 = 576; two RMSNorms 16 -> 896; x 2 layers = 1792;
    # embeddings 16 x 8 = 128, LM head 128, final norm 8 -> 2056
    assert counts["attention"] == 2 * 256 and counts["experts"] == 2 * 576 and counts["qk_norms"] == 2 * 16
    assert counts["total"] == 2056


@pytest.mark.parametrize("family", sorted(TINY))
def test_param_count_matches_transformers_models(family):
    shape = TINY[family]
    model = AutoModelForCausalLM.from_config(sp.standin_config(shape, shape["layers"]))
    assert sp.param_count(shape)["total"] == sum(p.numel() for p in model.parameters())
    deeper = AutoModelForCausalLM.from_config(sp.standin_config(shape, 3))
    assert sp.param_count(shape, layers=3)["total"] == sum(p.numel() for p in deeper.parameters())


@pytest.mark.parametrize("model_id,published_b", [
    ("Qwen/Qwen3-30B-A3B", 30.5), ("mistralai/Mixtral-8x7B-Instruct-v0.1", 46.7),
    ("allenai/OLMoE-1B-7B-0125-Instruct", 6.9),
])  # fmt: skip
def test_param_count_of_the_real_shapes_is_the_published_total(model_id, published_b):
    total = sp.param_count(sp.REAL_SHAPES[model_id])["total"]
    assert abs(total / 1e9 - published_b) < 0.05, total


def test_fit_line_recovers_a_line_and_least_squares():
    assert sp.fit_line([256, 512, 1024], [1000 + 3 * x for x in (256, 512, 1024)]) == pytest.approx((1000, 3))
    # (0, 0), (1, 2), (2, 1): x mean 1, y mean 1, slope (-1 * -1 + 1 * 0) / 2 = 0.5, intercept 1 - 0.5 = 0.5
    assert sp.fit_line([0, 1, 2], [0, 2, 1]) == pytest.approx((0.5, 0.5))
    with pytest.raises(ValueError):
        sp.fit_line([4, 4], [1, 2])


def _facts(**overrides):
    facts = dict(
        kind="eagle3", tokens_real=100, rows_real=2, length_real=50, compute_bytes=2, target_bytes=2,
        target_params_real=1000, hidden=4, experts=4, top_k=2, moe_layers_real=5, tracked_layers_real=5, budget=False,
        union_trained=True, slots=3, ttt_steps=3, block_size=4, num_anchors=8, draft_layers=1, anchors_per_row_real=50,
        anchors_real=100, anchors_per_token=0.75, union_anchors_real=10, aux_distinct_real=3,
    )
    facts.update(overrides)
    return facts


STANDIN = dict(moe_layers=2, tracked_layers=2, affinity_bytes_per_layer=100, affinity_step_bytes_per_layer=50,
               aux_distinct=2, draft_params=10, trainable_params=10)


def test_prediction_terms_by_hand():
    p = sp.predict_peak(_facts(), STANDIN, a=1000.0, b=10.0)
    items = p["items_bytes"]
    assert items["target_weights"] == 2000  # 1000 params x 2 B
    assert items["draft_weights_fp32"] == 40  # 10 x 4 B
    assert items["affinity_table"] == 500  # 100 B per tracked layer x 5
    assert items["step_intercept_a"] == 1000 and items["step_per_token_b_x_tokens"] == 1000  # 10 B x 100 tokens
    # 3 more MoE layers: per token 8 x 2 (ids) + 4 x 5 (one-hot, E + 1) + 4 x 4 (anchor routing) = 52 B -> 3 x 100 x 52
    # = 15600; 3 more tracked layers x 100 tokens x 8 x 2 (selected affinity rows) = 4800
    assert items["routing_ids_and_onehots"] == 20400
    assert items["anchor_routing_dflash"] == 0
    # union: 4 copies x K 3 x E 4 x 4 B = 192 B per anchor and layer; 3 more layers x 10 anchors = 5760
    assert items["union_term"] == 5760
    # the fit's 2 layers at 0.75 x 100 = 75 anchors, capped at 10: -2 x 192 x 65
    assert items["union_anchor_cap"] == -24960
    assert items["affinity_per_step_table"] == 150  # 3 more layers x 50 B
    assert items["aux_capture"] == 800  # 1 more distinct aux layer x H 4 x 100 tokens x 2 B
    # TTT masks of 2 rows x 50: steps k = 0..2 have 2 x 50 x (k + 1) x 50 = 5000, 10000, 15000 elements;
    # the bias in bf16 (2 B) of each, plus the last bool mask (1 B): 60000 + 15000
    assert items["attention_masks_real_rows"] == 75000
    assert p["total_bytes"] == 81690
    assert p["draft_grads_and_adam_bytes_in_a"] == 120  # 10 trained params x (4 B grad + 8 B AdamW)
    assert p["headroom"]["80GB"] == pytest.approx(1 - 81690 / 80e9)


def test_dflash_terms_by_hand():
    facts = _facts(kind="dflash", anchors_per_row_real=8, anchors_real=16, anchors_per_token=0.16, budget=True,
                   union_trained=False, draft_layers=2)
    items = sp.predict_peak(facts, STANDIN, a=0.0, b=0.0)["items_bytes"]
    # Q = 8 anchors x block 4 = 32 per row: 2 x 32 x (50 + 32) = 5248 elements, a bf16 bias per draft layer (2 x 2 B)
    # and the bool mask (1 B)
    assert items["attention_masks_real_rows"] == 5248 * 5
    # per token and MoE layer: ids 8 x 2 x 2 (budget: natural ids too) + one-hot 4 x 5 = 52 (no per-position anchor
    # routing); per anchor and MoE layer 4 x 4: 3 x 16 x 16 = 768
    assert items["routing_ids_and_onehots"] == 3 * 100 * 52 + 3 * 100 * 16
    assert items["anchor_routing_dflash"] == 768
    # union logged only: 2 copies x 3 x 4 x 4 = 96 B per anchor and layer
    assert items["union_term"] == 3 * 10 * 96
    assert items["union_anchor_cap"] == -2 * 96 * (16 - 10)


def test_stated_hardware_and_verdict():
    with open(os.path.join(REPO, "recipes", "olmoe_1b_7b", "eagle3.yaml")) as f:
        hardware = sp.stated_hardware(f.read())
    assert hardware == {"gpus": 8, "memory_gb": 80.0}  # "8 GPUs of 80 GB (H100 / A100)"
    assert sp.stated_hardware("# Launch (8 H200 GPUs)\nmethod: vat\n") == {"gpus": 8, "memory_gb": 141.0}
    assert sp.stated_hardware("# 4 x 80 GB GPUs\n")["memory_gb"] == 80.0
    assert sp.stated_hardware("# A100 40GB, 8 GPUs\n") == {"gpus": 8, "memory_gb": 40.0}
    with open(os.path.join(REPO, "recipes", "qwen3_30b_a3b", "dflash_vat.yaml")) as f:
        dflash_header = f.read()  # "~2.3 GB per sequence", "an 80 GB card": sizes, not the stated GPUs (H200)
    assert sp.stated_hardware(dflash_header) == {"gpus": 8, "memory_gb": 141.0}
    unstated = sp.stated_hardware("# Launch (one node, 8 GPUs; the target is replicated per rank)\n")
    assert unstated == {"gpus": 8, "memory_gb": None}
    fits = sp.verdict(70e9, unstated)  # 12.5 % free of 80 GB, judged at 80 GB because the header names no memory
    assert fits["assumed"] and fits["fits"] and math.isclose(fits["headroom"], 0.125)
    assert not sp.verdict(73e9, unstated)["fits"]  # 8.75 % free
    assert not sp.verdict(73e9, hardware)["assumed"]  # a stated 80 GB is judged as stated


def test_real_recipes_are_listed_and_read_at_their_real_shape():
    keep, skipped = sp.list_recipes([])
    assert skipped == ["recipes/olmoe_1b_7b/window_pool.yaml"]
    assert len(keep) == 10 and all(not p.endswith("window_pool.yaml") for p in keep)
    facts = sp.recipe_facts(os.path.join(REPO, "recipes", "olmoe_1b_7b", "eagle3_vat_budget.yaml"))
    assert (facts["tokens_real"], facts["rows_real"], facts["length_real"]) == (16384, 8, 2048)
    assert facts["budget"] and facts["union_trained"] and facts["union_anchors_real"] == 1024
    assert facts["moe_layers_real"] == facts["tracked_layers_real"] == 16
    dflash = sp.recipe_facts(os.path.join(REPO, "recipes", "qwen3_30b_a3b", "dflash_vat.yaml"))
    assert (dflash["rows_real"], dflash["length_real"], dflash["anchors_real"]) == (1, 3072, 512)  # one 3,072-token row per micro-batch, 512 anchors each
    assert dflash["tracked_layers_real"] == 24  # affinity_layer_stride 2 over 48 layers
    assert sp.cell_rows(facts, [64, 128, 256]) == 4  # 8 rows of 8 would be shorter than 2 x (K + 1) = 16
    assert sp.cell_rows(facts, [256, 512, 1024]) == 8


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "mixtral"])
def test_standin_builds_and_loads_in_vat_with_two_layers(tmp_path, family):
    shape = dict(TINY[family], layers=48)  # the full depth is only the memory model's: the stand-in has 2
    path = str(tmp_path / "standin")
    info = sp.build_standin(shape, path)
    assert info["layers"] == 2 and info["params"] == info["analytic_params"] == sp.param_count(shape, 2)["total"]
    assert info["bytes"] == 2 * info["params"]  # bfloat16
    assert not os.path.exists(path + ".building")
    target = load_target(path, dtype="float32", device="cpu", experts_impl="eager")
    try:
        assert target.num_layers == 2 and len(target.moe_layer_ids) == 2
        assert (target.num_experts, target.top_k) == (shape["experts"], shape["top_k"])
        assert (target.hidden_size, target.vocab_size) == (shape["hidden"], shape["vocab"])
        assert target.aux_layer_ids == [1, 0, 0]  # vat's EAGLE-3 default clamped into 2 layers: valid
        assert target.config.model_type == family
        if "norm_topk_prob" in shape:
            assert target.config.norm_topk_prob == shape["norm_topk_prob"]
        out = target(torch.randint(0, shape["vocab"], (1, 5)))
        assert out.topk_ids.shape == (2, 1, 5, shape["top_k"]) and out.aux_hidden.shape == (1, 5, 3 * shape["hidden"])
    finally:
        target.close()


def test_one_cell_runs_two_steps_of_a_real_recipe_on_a_tiny_standin(tmp_path):
    """The worker's path end to end (the recipe's trainer, the overrides, the hooks, the breakdown) at tiny dims."""
    recipe = os.path.join(REPO, "recipes", "olmoe_1b_7b", "eagle3_vat.yaml")
    shape = dict(TINY["olmoe"], vocab=64)
    standin = str(tmp_path / "standin")
    sp.build_standin(shape, standin)
    facts = sp.recipe_facts(recipe)
    rows = sp.cell_rows(facts, [64])
    data = sp.ensure_data(str(tmp_path / "data"), shape["vocab"], facts["draft_vocab_size"], 64, rows)
    options = argparse.Namespace(experts_impl="eager", target_dtype="float32", mixed_precision="no")
    work = str(tmp_path / "work")
    overrides = sp.cell_overrides(facts, standin, data, 64, rows, options, work)
    cell = sp.run_cell({"recipe": recipe, "threads": 1, "vat_root": REPO, "overrides": overrides})
    assert cell["batch_shapes"] == [[4, 16], [4, 16]] and cell["budgeted_steps"] == [False, False]
    assert len(cell["step_s"]) == 2 and cell["step2_s"] == cell["step_s"][1]
    assert cell["moe_layers"] == cell["tracked_layers"] == 2 and cell["aux_distinct"] == 2
    assert cell["optimizer_state_bytes"] >= 8 * cell["trainable_params"] > 0  # AdamW's two fp32 moments
    assert cell["step_bytes"] == cell["peak_bytes"] - cell["before_bytes"]
    assert cell["vat_file"].startswith(os.path.join(REPO, "vat"))
    assert not os.path.exists(os.path.join(work, "final"))  # no final write
    import vat.train.setup as setup_module

    assert sp.target_loader_module() is setup_module  # the module whose load_target the trainer's setup calls
    assert setup_module.load_target is load_target  # the worker's wrapper is gone


def test_fit_prediction_and_report_from_cells(tmp_path):
    recipe = "recipes/olmoe_1b_7b/eagle3.yaml"
    facts = sp.recipe_facts(os.path.join(REPO, recipe))
    cells = {}
    for rev, scale in (("current", 1.0), ("baseline@abc", 2.0)):
        for tokens in (64, 128, 256):
            cells[sp.cell_key(rev, recipe, tokens)] = dict(
                STANDIN, recipe=recipe, revision=rev, tokens=tokens, rows=4, length=tokens // 4,
                step_bytes=scale * (1e9 + 1e5 * tokens), step2_s=scale * tokens / 64)
    results = {"cells": cells, "failed": {}, "recipes": {}, "skipped": ["recipes/olmoe_1b_7b/window_pool.yaml"]}
    model = sp.model_for(recipe, "current", facts, results)
    assert model["a_bytes"] == pytest.approx(1e9) and model["b_bytes_per_token"] == pytest.approx(1e5)
    assert model["max_residual_bytes"] < 1e-3 * 1e9
    prediction = model["prediction"]
    assert prediction["items_bytes"]["step_per_token_b_x_tokens"] == pytest.approx(1e5 * 16384)
    assert prediction["total_bytes"] == pytest.approx(sum(prediction["items_bytes"].values()))
    assert not model["verdict"]["assumed"] and model["verdict"]["judged_against_gb"] == 80.0  # the recipe's 80 GB
    results["recipes"][recipe] = {"facts": facts, "models": {"current": model}}
    with open(sp.write_markdown(results, ["current", "baseline@abc"], str(tmp_path))) as f:
        md = f.read()
    # 256 tokens: 1e9 + 2.56e7 B = 1026 MB, 4 s; the baseline twice both: ratios 0.50
    assert "| 256 | 4 x 64 | 1026 | 4.00 | 2051 | 0.50 | 8.00 | 0.50 |" in md
    assert f"| {recipe} | 1000 | 100.0 | 16384 | {prediction['total_bytes'] / 1e9:.1f} |" in md
    assert "8 GPUs, 80 GB | yes" in md and "window_pool.yaml" in md
