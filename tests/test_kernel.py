"""The budgeted fused-MoE Triton kernel under TRITON_INTERPRET=1 (set by conftest.py), fp32, tiny shapes.

Parity against the torch reference and against transformers' own eager experts forward, for natural and budgeted
routings, plus the alignment against its slow reference and the set of experts the kernel reads.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, tiny_model
from transformers import OlmoeConfig, Qwen3MoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from vat.errors import VatError
from vat.kernels.align import align_block_size, align_block_size_reference, max_blocks_bound
from vat.kernels.fused_moe import INTERPRETED, KernelConfig, expert_bytes, fused_experts, record_experts_read
from vat.kernels.layout import ExpertsLayout
from vat.kernels.reference import fused_experts_reference
from vat.kernels.registry import check_triton_experts_supported, register_triton_experts

# ---------------------------------------------------------------------------------------------------------------------
# Local routing helpers (the real budget policies live in vat/target; these state the rules the kernel must honour).


def natural_routing(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMoE / Qwen3-MoE routing: softmax in fp32, top-k, optional renormalisation. Returns ``(ids, weights)``."""
    probs = logits.float().softmax(-1)  # (T, E)
    weights, ids = probs.topk(top_k, dim=-1)  # (T, k)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def budget_set(logits: torch.Tensor, budget: int, top_k: int) -> torch.Tensor:
    """S: the window's natural union if it has at most ``budget`` experts, else its top-``budget`` experts by summed
    softmax mass (docs/verification_policies.md). ``(|S|,)``"""
    probs = logits.float().softmax(-1)  # (T, E)
    union = probs.topk(top_k, dim=-1).indices.unique()
    return union if union.numel() <= budget else probs.sum(0).topk(budget).indices


def substitute_routing(logits, top_k, norm_topk_prob, allowed):
    """Top-k rerun inside ``allowed``; weights are the unmasked probabilities of the chosen experts (renormalised if
    ``norm_topk_prob``), so a token whose natural top-k lies inside ``allowed`` keeps its natural weights."""
    probs = logits.float().softmax(-1)  # (T, E)
    inside = torch.zeros_like(probs, dtype=torch.bool)
    inside[:, allowed] = True
    ids = probs.masked_fill(~inside, -1.0).topk(top_k, dim=-1).indices  # (T, k)
    weights = probs.gather(-1, ids)  # (T, k) unmasked probabilities
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def truncate_routing(logits, top_k, norm_topk_prob, allowed):
    """Out-of-budget slots become the sentinel E with weight 0; the kept weights are rescaled to the token's original
    total (a token with no kept slot gets all-zero weights)."""
    num_experts = logits.shape[-1]
    ids, weights = natural_routing(logits, top_k, norm_topk_prob)
    keep = torch.isin(ids, allowed)  # (T, k)
    kept = weights * keep
    kept_total = kept.sum(-1, keepdim=True)  # (T, 1)
    scale = torch.where(kept_total > 0, weights.sum(-1, keepdim=True) / kept_total.clamp_min(1e-30), 0.0)
    return torch.where(keep, ids, num_experts), kept * scale


def route(logits, top_k, norm_topk_prob, budget=None, policy="substitute"):
    if budget is None:
        return natural_routing(logits, top_k, norm_topk_prob)
    allowed = budget_set(logits, budget, top_k)
    fn = substitute_routing if policy == "substitute" else truncate_routing
    return fn(logits, top_k, norm_topk_prob, allowed)


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures


def hf_experts(kind: str, hidden: int, inter: int, num_experts: int, top_k: int, seed: int = 0):
    """A real transformers experts module with random weights, dispatching through ``eager``."""
    torch.manual_seed(seed)
    if kind == "olmoe":
        config = OlmoeConfig(
            hidden_size=hidden, intermediate_size=inter, num_experts=num_experts, num_experts_per_tok=top_k
        )
        module = OlmoeExperts(config)
    else:
        config = Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts, num_experts_per_tok=top_k
        )
        module = Qwen3MoeExperts(config)
    config._experts_implementation = "eager"
    with torch.no_grad():
        module.gate_up_proj.normal_(0.0, hidden**-0.5)
        module.down_proj.normal_(0.0, inter**-0.5)
    return module.requires_grad_(False).eval()


def run_hf(module, hidden_states, ids, weights, impl="eager"):
    module.config._experts_implementation = impl
    try:
        with torch.no_grad():
            return module(hidden_states, ids, weights)
    finally:
        module.config._experts_implementation = "eager"


def kernel(module, hidden_states, ids, weights, **kwargs):
    return fused_experts(hidden_states, module.gate_up_proj, module.down_proj, ids, weights, **kwargs)


def reference(module, hidden_states, ids, weights):
    return fused_experts_reference(hidden_states, module.gate_up_proj, module.down_proj, ids, weights)


def test_interpreter_is_on():
    assert INTERPRETED, "conftest.py must set TRITON_INTERPRET=1 before vat.kernels.fused_moe is imported"


# ---------------------------------------------------------------------------------------------------------------------
# Alignment


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,block_size,drop_frac",
    [(1, 2, 8, 16, 0.0), (13, 2, 8, 16, 0.3), (16, 4, 64, 16, 0.0), (40, 8, 64, 32, 0.5), (5, 3, 4, 4, 1.0)],
)
def test_align_matches_slow_reference(num_tokens, top_k, num_experts, block_size, drop_frac):
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])  # (T, k)
    ids[torch.rand(num_tokens, top_k) < drop_frac] = num_experts  # sentinel: dropped slot
    fast = align_block_size(ids, num_experts, block_size)
    slow = align_block_size_reference(ids, num_experts, block_size)
    assert fast.used() == slow.used()
    assert fast.num_tokens_post_padded.tolist() == slow.num_tokens_post_padded.tolist()
    present = sorted(set(ids[ids < num_experts].tolist()))
    assert fast.experts_read() == slow.experts_read() == present
    pairs = num_tokens * top_k
    # The grid bound holds and never depends on num_experts beyond min(E, P); the unused tail is inert.
    assert slow.max_blocks <= fast.max_blocks == max_blocks_bound(pairs, num_experts, block_size)
    assert fast.max_blocks <= min(pairs, -(-pairs // block_size) + min(num_experts, pairs))
    assert set(fast.block_expert_ids[slow.max_blocks :].tolist()) <= {-1}
    assert set(fast.sorted_pair_ids[slow.max_blocks * block_size :].tolist()) <= {pairs}
    valid_pairs = sorted(p for p in fast.sorted_pair_ids.tolist() if p != pairs)
    assert valid_pairs == [p for p in range(pairs) if ids.reshape(-1)[p] < num_experts]


def test_align_vllm_docstring_example():
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, block_experts = align_block_size(ids, num_experts=5, block_size=4).used()
    assert sorted_ids == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert block_experts == [1, 2, 3, 4]


def test_align_rejects_out_of_range_ids():
    with pytest.raises(VatError, match="expert id 9 out of range"):
        align_block_size(torch.tensor([[0, 9]]), num_experts=8, block_size=16)
    with pytest.raises(VatError, match="expert id -1 out of range"):
        align_block_size(torch.tensor([[0, -1]]), num_experts=8, block_size=16)


# ---------------------------------------------------------------------------------------------------------------------
# Kernel parity: reference and transformers eager

CASES = [
    # (kind, T, H, inter, E, k, budget, policy)
    ("qwen3", 13, 64, 48, 8, 2, None, None),  # T not a multiple of the block size; I not a power of two
    ("olmoe", 1, 64, 32, 8, 2, None, None),  # a single token
    ("olmoe", 10, 64, 32, 8, 2, 3, "substitute"),
    ("olmoe", 10, 64, 32, 8, 2, 3, "truncate"),
    ("qwen3", 10, 64, 32, 8, 2, 3, "substitute"),
    ("qwen3", 10, 64, 32, 8, 2, 3, "truncate"),
    ("qwen3", 5, 128, 64, 64, 4, None, None),
    ("olmoe", 9, 128, 64, 64, 4, 6, "substitute"),
    ("qwen3", 9, 128, 64, 64, 4, 6, "truncate"),
]


@pytest.mark.parametrize("kind,T,H,inter,E,k,budget,policy", CASES)
def test_kernel_matches_reference_and_hf_eager(kind, T, H, inter, E, k, budget, policy):
    module = hf_experts(kind, H, inter, E, k)
    x = torch.randn(T, H)
    logits = torch.randn(T, E) * 2.0
    ids, weights = route(logits, k, norm_topk_prob=kind == "qwen3", budget=budget, policy=policy)
    out = kernel(module, x, ids, weights)
    torch.testing.assert_close(out, reference(module, x, ids, weights), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, run_hf(module, x, ids, weights), atol=1e-5, rtol=1e-5)
    if budget is not None:
        assert set(ids[ids < E].tolist()) <= set(budget_set(logits, budget, k).tolist())


@pytest.mark.parametrize("policy", ["substitute", "truncate"])
def test_budget_at_least_union_is_identical_to_unbudgeted(policy):
    T, H, inter, E, k = 8, 64, 32, 8, 2
    module = hf_experts("qwen3", H, inter, E, k)
    x = torch.randn(T, H)
    logits = torch.randn(T, E) * 2.0
    ids, weights = route(logits, k, True)
    union = ids.unique().numel()
    for budget in (union, E):
        b_ids, b_weights = route(logits, k, True, budget=budget, policy=policy)
        assert torch.equal(b_ids, ids) and torch.equal(b_weights, weights)
        assert torch.equal(kernel(module, x, b_ids, b_weights), kernel(module, x, ids, weights))


def test_tokens_with_every_slot_dropped_get_zero_output():
    T, H, inter, E, k = 7, 64, 32, 8, 2
    module = hf_experts("olmoe", H, inter, E, k)
    x = torch.randn(T, H)
    logits = torch.randn(T, E) * 3.0
    ids, weights = route(logits, k, False, budget=2, policy="truncate")
    ids[[0, 4]] = E  # force two fully dropped tokens whatever the random routing did
    weights[[0, 4]] = 0.0
    out = kernel(module, x, ids, weights)
    all_dropped = (ids == E).all(-1)  # (T,)
    assert all_dropped.sum() >= 2
    assert torch.equal(out[all_dropped], torch.zeros_like(out[all_dropped]))
    assert out[~all_dropped].abs().amax(-1).min() > 0
    torch.testing.assert_close(out, run_hf(module, x, ids, weights), atol=1e-5, rtol=1e-5)
    every_slot_dropped = torch.full((T, k), E)
    assert torch.equal(kernel(module, x, every_slot_dropped, weights), torch.zeros(T, H))


def test_explicit_small_blocks_and_transposed_interleaved_biased_layout():
    """Several M-blocks per expert and several K iterations; plus the GPT-OSS layout against the reference."""
    T, H, inter, E, k = 20, 64, 32, 4, 2
    module = hf_experts("olmoe", H, inter, E, k)
    x = torch.randn(T, H)
    ids, weights = route(torch.randn(T, E), k, False)
    small = KernelConfig(block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(kernel(module, x, ids, weights, config=small), reference(module, x, ids, weights))

    layout = ExpertsLayout(is_transposed=True, is_concatenated=False, activation="gpt_oss_glu", alpha=1.702, limit=0.5)
    w1 = torch.randn(E, H, 2 * inter) * H**-0.5  # (E, H, 2I)
    w2 = torch.randn(E, inter, H) * inter**-0.5  # (E, I, H)
    b1, b2 = torch.randn(E, 2 * inter), torch.randn(E, H)
    kw = dict(gate_up_bias=b1, down_bias=b2, layout=layout)
    ids[0, 1], ids[3] = E, E  # dropped slots: biases must not leak into them either
    torch.testing.assert_close(
        fused_experts(x, w1, w2, ids, weights, **kw), fused_experts_reference(x, w1, w2, ids, weights, **kw)
    )


# ---------------------------------------------------------------------------------------------------------------------
# Experts read


@pytest.mark.parametrize("policy", ["substitute", "truncate"])
def test_experts_read_equal_the_budget_set(policy):
    T, H, inter, E, k, budget = 12, 64, 32, 64, 4, 4
    module = hf_experts("qwen3", H, inter, E, k)
    x = torch.randn(T, H)
    logits = torch.randn(T, E) * 2.0
    ids, weights = route(logits, k, True, budget=budget, policy=policy)
    allowed = set(budget_set(logits, budget, k).tolist())
    used = set(ids[ids < E].tolist())
    if policy == "substitute":
        assert used == allowed  # k == B: every token takes all of S
    with record_experts_read() as calls:
        kernel(module, x, ids, weights)
    assert len(calls) == 1
    assert set(calls[0].experts) == used <= allowed
    assert calls[0].num_experts == E
    assert calls[0].bytes_read == len(used) * expert_bytes(module.gate_up_proj, module.down_proj)
    natural_ids, _ = route(logits, k, True)
    assert natural_ids.unique().numel() > budget  # the budget did bind


def test_record_experts_read_nests_and_stops():
    module = hf_experts("olmoe", 64, 32, 8, 2)
    x = torch.randn(3, 64)
    ids, weights = torch.tensor([[1, 5], [5, 8], [8, 8]]), torch.rand(3, 2)
    with record_experts_read() as outer:
        kernel(module, x, ids, weights)
        with record_experts_read() as inner:
            kernel(module, x, ids, weights)
    kernel(module, x, ids, weights)
    assert [c.experts for c in outer] == [(1, 5), (1, 5)]
    assert [c.experts for c in inner] == [(1, 5)]


def test_refuses_inputs_that_need_grad():
    module = hf_experts("olmoe", 64, 32, 8, 2).requires_grad_(True)
    ids, weights = torch.tensor([[1, 5]]), torch.rand(1, 2)
    with pytest.raises(VatError, match="no backward"):
        kernel(module, torch.randn(1, 64), ids, weights)


# ---------------------------------------------------------------------------------------------------------------------
# Through real tiny transformers models


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_logits_match_eager(family):
    name = register_triton_experts()
    assert name == "vat_triton" and register_triton_experts() == name  # idempotent
    model = tiny_model(family)
    input_ids = torch.randint(3, 128, (2, 7))
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        model.set_experts_implementation("eager")
        expected = model(input_ids).logits
        assert check_triton_experts_supported(model) == n_layers
        model.set_experts_implementation(name)
        with record_experts_read() as calls:
            got = model(input_ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert len(calls) == n_layers
    assert all(0 < len(c.experts) <= c.num_experts for c in calls)


def test_non_silu_experts_are_refused():
    register_triton_experts()
    model = tiny_model("olmoe")
    model.config.hidden_act = "gelu"
    from transformers.activations import ACT2FN

    for layer in model.model.layers:
        layer.mlp.experts.act_fn = ACT2FN["gelu"]
    with pytest.raises(VatError, match="only SiLU-gated experts"):
        check_triton_experts_supported(model)
    model.set_experts_implementation("vat_triton")
    with torch.no_grad(), pytest.raises(VatError, match="GELU"):
        model(torch.randint(3, 128, (1, 4)))


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])  # softmax top-k; sigmoid + bias + group limit
def test_budgeted_target_forward_matches_eager(family):
    """Through vat.target: a budgeted forward with experts_impl triton equals the eager one, and each layer's kernel
    call reads exactly the experts the budgeted routing executed (at most B)."""
    from vat.target import BudgetSpec, load_target

    budget = 2
    input_ids = torch.randint(3, 128, (1, 8))
    outputs, calls = {}, []
    for impl in ("eager", "triton"):
        target = load_target(tiny_model(family), device="cpu", experts_impl=impl)
        try:
            with record_experts_read() as recorded:
                outputs[impl] = [
                    target.forward(input_ids, budget=BudgetSpec(B=budget, policy=policy))
                    for policy in ("substitute", "truncate")
                ]
            if impl == "eager":
                natural = target.forward(input_ids)
        finally:
            target.close()
        calls += recorded
    num_experts, n_layers = target.num_experts, natural.topk_ids.shape[0]
    assert max(len(set(layer.reshape(-1).tolist())) for layer in natural.topk_ids) > budget  # the budget binds
    assert len(calls) == 2 * n_layers  # the eager target never calls the kernel
    for p, (eager, triton_out) in enumerate(zip(outputs["eager"], outputs["triton"])):
        assert torch.equal(triton_out.topk_ids, eager.topk_ids)
        torch.testing.assert_close(triton_out.logits, eager.logits, atol=1e-5, rtol=0)
        for layer in range(n_layers):
            executed = set(eager.topk_ids[layer].reshape(-1).tolist()) - {num_experts}
            assert set(calls[p * n_layers + layer].experts) == executed
            assert len(executed) <= budget


def test_kernels_lower_for_hopper_and_pipeline():
    """The interpreter never compiles: lower both kernels for sm_90 (bundled ptxas, no GPU) with the shipping bf16
    configuration, and check the K loop was software-pipelined (its loads became asynchronous copies)."""
    from vat.kernels.aot import compile_kernels_subprocess

    infos = compile_kernels_subprocess(dtype="bf16", arch=90, block_m=16, block_n=64, block_k=128, num_stages=3)
    assert [i["name"] for i in infos] == ["_gate_up_act_kernel", "_down_kernel"]
    assert all(i["pipelined"] for i in infos)
    assert all(i["shared_bytes"] <= 227 * 1024 for i in infos)  # fits an H100/H200 SM


# ---------------------------------------------------------------------------------------------------------------------
# Refusals at load time (issue 14.1): what the kernel cannot run is refused in one line before any forward


def fp8_olmoe():
    """A tiny OLMoE whose experts hold float8_e4m3fn weights (as a quantized checkpoint would, minus its scales)."""
    model = tiny_model("olmoe").requires_grad_(False)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.gate_up_proj.data = experts.gate_up_proj.data.to(torch.float8_e4m3fn)
        experts.down_proj.data = experts.down_proj.data.to(torch.float8_e4m3fn)
    return model


def test_fp8_experts_are_refused_at_load():
    with pytest.raises(VatError, match="OlmoeExperts gate_up_proj is float8_e4m3fn") as err:
        check_triton_experts_supported(fp8_olmoe())
    assert "\n" not in str(err.value)
    from vat.target import load_target

    with pytest.raises(VatError, match="float8_e4m3fn; the Triton experts kernel runs float32, bfloat16, float16"):
        load_target(fp8_olmoe(), device="cpu", experts_impl="triton")
    module = hf_experts("olmoe", 64, 32, 8, 2)
    w1, w2 = module.gate_up_proj.to(torch.float8_e4m3fn), module.down_proj.to(torch.float8_e4m3fn)
    with pytest.raises(VatError, match="fused_experts: gate_up_proj is float8_e4m3fn"):
        fused_experts(torch.randn(2, 64), w1, w2, torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2))
    with pytest.raises(VatError, match="needs one weight dtype"):
        fused_experts(
            torch.randn(2, 64), module.gate_up_proj, w2.half(), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
        )


def test_transformers_fp8_experts_module_is_refused():
    """transformers' own FP8Experts (what a fine-grained FP8 checkpoint loads into) dispatch through an interface
    where vat_triton is not registered: refused at the check, not with a KeyError at the first forward."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers.integrations.moe import use_experts_implementation

    cls = use_experts_implementation(experts_class=fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    model = tiny_model("olmoe")
    model.model.layers[1].mlp.experts = cls(config=model.config, block_size=(16, 16))
    with pytest.raises(VatError, match="FP8Experts gate_up_proj is float8_e4m3fn"):
        check_triton_experts_supported(model)


@pytest.mark.parametrize("field,value", [("block_m", 8), ("block_n", 8), ("block_k", 4), ("block_k", 48)])
def test_block_sizes_below_16_or_not_powers_of_two_are_refused(field, value):
    with pytest.raises(VatError, match=f"KernelConfig.{field} must be a power of two >= 16"):
        KernelConfig(**{field: value})
    assert KernelConfig(block_m=None).block_m is None and KernelConfig(block_m=16).block_m == 16


def test_tensors_on_different_devices_are_refused():
    module = hf_experts("olmoe", 64, 32, 8, 2)
    w2 = module.down_proj.to("meta")
    with pytest.raises(VatError, match="down_proj is on meta but hidden_states is on cpu"):
        fused_experts(torch.randn(2, 64), module.gate_up_proj, w2, torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2))
