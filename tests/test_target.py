"""The frozen target: routing capture, aux features, and expert budgeting against brute-force references."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_budget, router_io
from tiny_models import FAMILIES, tiny_model

from vat.errors import VatError
from vat.target import (
    BudgetSpec,
    default_aux_layer_ids,
    load_target,
    vat_to_sglang_aux_ids,
    vat_to_vllm_aux_ids,
    vllm_to_vat_aux_ids,
    window_union,
)
from vat.target.accounting import contiguous_windows

SEQ = 12


@pytest.fixture(params=FAMILIES)
def family_target(request):
    model = tiny_model(request.param)
    target = load_target(model, device="cpu")
    yield request.param, model, target
    target.close()


def test_capture_equals_each_models_own_routing(family_target):
    family, _, target = family_target
    ids = torch.randint(3, 128, (2, SEQ))
    records, handles = router_io(target)
    out = target.forward(ids)
    for h in handles:
        h.remove()
    assert out.topk_ids.shape == (len(target.moe_layer_ids), 2, SEQ, target.top_k)
    for ordinal, (_, router, _) in enumerate(target.routing.moe_layers):
        # the router's own forward, outside any vat context, on the same input
        _, _, own_ids = router(records[ordinal]["input"])
        assert torch.equal(out.topk_ids[ordinal].reshape(-1, target.top_k), own_ids), family


def test_aux_hidden_states_are_layer_outputs(family_target):
    _, model, target = family_target
    ids = torch.randint(3, 128, (1, SEQ))
    outputs = {}
    layers = model.model.layers
    hooks = [layers[i].register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i in set(target.aux_layer_ids)]
    out = target.forward(ids)
    for h in hooks:
        h.remove()
    hidden = target.hidden_size
    for slot, layer in enumerate(target.aux_layer_ids):
        assert torch.equal(out.aux_hidden[..., slot * hidden:(slot + 1) * hidden], outputs[layer])
    assert out.final_hidden.shape == (1, SEQ, hidden)


def test_budget_at_least_union_is_bit_identical(family_target):
    family, model, target = family_target
    ids = torch.randint(3, 128, (2, SEQ))
    natural = target.forward(ids)
    for window in (1, 4, 8):
        groups, n = contiguous_windows(torch.ones(2, SEQ, dtype=torch.bool), window)
        max_union = int(window_union(natural.topk_ids, groups, n, target.num_experts).max())
        for policy in ("substitute", "truncate", "truncate_cover"):
            budgeted = target.forward(ids, budget=BudgetSpec(B=max_union, window=window, policy=policy))
            assert torch.equal(budgeted.logits, natural.logits), (family, window, policy)
            assert torch.equal(budgeted.topk_ids, natural.topk_ids)


# ---- budgets below the union against the brute-force reference (helpers.reference_budget) ----------------------------

@pytest.mark.parametrize("policy", ["substitute", "truncate", "truncate_cover"])
def test_budget_below_union_matches_brute_force(family_target, policy):
    family, _, target = family_target
    ids = torch.randint(3, 128, (2, SEQ))
    budget, window = 2 if target.top_k <= 2 else target.top_k, 4
    records, handles = router_io(target)
    out = target.forward(ids, budget=BudgetSpec(B=budget, window=window, policy=policy))
    for h in handles:
        h.remove()
    unions = window_union(out.topk_ids, out.window_groups, out.n_windows, target.num_experts)
    assert int(unions.max()) <= budget
    natural = target.forward(ids)
    groups_nat, n_nat = contiguous_windows(torch.ones(2, SEQ, dtype=torch.bool), window)
    assert int(window_union(natural.topk_ids, groups_nat, n_nat, target.num_experts).max()) > budget  # really cut
    groups = out.window_groups.reshape(-1).tolist()
    for ordinal, (_, router, _) in enumerate(target.routing.moe_layers):
        logits, nat_w, nat_ids = router(records[ordinal]["input"])  # natural routing of the budgeted run's input
        expected = reference_budget(family, router, logits, nat_w, nat_ids, groups, budget, policy)
        _, got_w, got_ids = records[ordinal]["output"]
        for t, want in enumerate(expected):
            got = {e: w for e, w in zip(got_ids[t].tolist(), got_w[t].tolist()) if e != target.num_experts}
            assert set(got) == set(want), (family, policy, ordinal, t)
            for e in want:
                assert got[e] == pytest.approx(want[e], rel=1e-5, abs=1e-6), (family, policy, ordinal, t)


def test_batch_scope_shares_one_budget_across_rows():
    target = load_target(tiny_model("olmoe"), device="cpu")
    ids = torch.randint(3, 128, (3, 8))
    out = target.forward(ids, budget=BudgetSpec(B=3, scope="batch"))
    assert out.n_windows == 1
    experts = {e for e in out.topk_ids[0].reshape(-1).tolist() if e != target.num_experts}
    assert len(experts) <= 3


def test_per_layer_budgets_and_prefill_unbudgeted():
    target = load_target(tiny_model("qwen3_moe"), device="cpu")
    ids = torch.randint(3, 128, (1, 16))
    natural = target.forward(ids)
    spec = BudgetSpec(B={0: 2}, window=4, start_position=8)  # only layer 0, only positions >= 8
    out = target.forward(ids, budget=spec)
    assert torch.equal(out.topk_ids[0, :, :8], natural.topk_ids[0, :, :8])  # prefill untouched in layer 0
    # (experts batch different token sets, so the prefill logits agree to float rounding, not bit for bit)
    assert torch.allclose(out.logits[:, :8], natural.logits[:, :8], atol=1e-6)
    assert not torch.equal(out.topk_ids[0, :, 8:], natural.topk_ids[0, :, 8:])
    unions = window_union(out.topk_ids[:1], out.window_groups, out.n_windows, target.num_experts)
    assert int(unions.max()) <= 2


def test_padding_is_never_budgeted_or_counted():
    target = load_target(tiny_model("olmoe"), device="cpu")
    ids = torch.randint(3, 128, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    out = target.forward(ids, attention_mask=mask, budget=BudgetSpec(B=2, window=4))
    assert (out.window_groups[1, :3] == -1).all()


def test_aux_layer_conventions():
    assert default_aux_layer_ids(32) == [1, 15, 28]
    assert vat_to_vllm_aux_ids([1, 15, 28]) == [2, 16, 29]  # vLLM names the layer whose input it captures
    assert vat_to_sglang_aux_ids([1, 15, 28]) == [1, 15, 28]  # SGLang config ids name layer outputs (+1 inside)
    assert vllm_to_vat_aux_ids(vat_to_vllm_aux_ids([1, 15, 28])) == [1, 15, 28]


def test_expert_bytes_from_shapes_and_dtype():
    model = tiny_model("olmoe").to(torch.bfloat16)
    target = load_target(model, device="cpu", dtype="bfloat16")
    cfg = model.config
    per_expert = 3 * cfg.hidden_size * cfg.intermediate_size * 2  # gate, up, down; 2 bytes
    assert target.expert_bytes_per_layer() == [per_expert] * cfg.num_hidden_layers


def test_bad_inputs_fail_with_one_clear_line(tmp_path):
    with pytest.raises(VatError, match="target not found"):
        load_target(str(tmp_path / "nope" / "model"))
    with pytest.raises(VatError, match="unknown budget policy"):
        BudgetSpec(B=2, policy="drop")
    with pytest.raises(VatError, match="aux layer id 7 out of range"):
        load_target(tiny_model("olmoe"), device="cpu", aux_layer_ids=[0, 1, 7])
    with pytest.raises(VatError, match="unknown experts implementation"):
        load_target(tiny_model("olmoe"), device="cpu", experts_impl="fast")


def test_load_from_pretrained_directory(tmp_path):
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path / "mixtral")
    target = load_target(str(tmp_path / "mixtral"), device="cpu", dtype="float32")
    ids = torch.randint(3, 128, (1, 6))
    ref = load_target(model, device="cpu")
    assert torch.allclose(target.forward(ids).logits, ref.forward(ids).logits, atol=1e-6)
    assert target.path == str(tmp_path / "mixtral")
