"""The kernel on routings produced by vat's own budgeting code (issue 14.3), interpreter mode, fp32.

``tests/test_kernel.py`` routes with helpers of its own; here ``(topk_ids, topk_weights)`` come from the library:
each family's real router (tiny transformers model, 16 experts, top-4), :func:`vat.target.budget.window_groups` and
:func:`vat.target.budget.apply_budget` — the exact calls the router hook makes — and, end to end, ``load_target(...,
experts_impl="triton")`` with ``FrozenTarget.forward(budget=...)``. Budgets cover B < k, k < B < the window's natural
union (the budget binds) and union ≤ B < E (the budget fits; not B = E, which returns before any budgeting), with
enough tokens that the selected experts' pair runs span several 16-row M-blocks. The kernel is compared with
:func:`vat.kernels.reference.fused_experts_reference` (independent fp32 per-expert loop) and with transformers' eager
experts forward on the same routing. Only the budget's public contract is asserted here (at most B experts per
window; natural routing when the union fits), not its selection rule, which vat.target owns.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, tiny_model

from vat.kernels.fused_moe import KernelConfig, fused_experts, record_experts_read
from vat.kernels.reference import fused_experts_reference
from vat.kernels.registry import experts_layout
from vat.target.budget import BudgetSpec, apply_budget, window_groups
from vat.target.families import adapter_for

NUM_EXPERTS, TOP_K, BLOCK_M, HIDDEN = 16, 4, 16, 64  # HIDDEN: tiny_models' hidden_size
SMALL_BLOCKS = KernelConfig(block_m=BLOCK_M, block_n=32, block_k=32)  # several N and K tiles per program too


def moe_layer(family: str):
    """``(adapter, router, experts)`` of the first MoE layer of a tiny ``family`` model with 16 experts, top-4."""
    model = tiny_model(family, num_experts=NUM_EXPERTS, top_k=TOP_K).requires_grad_(False)
    adapter = adapter_for(model.config)
    _, block = adapter.moe_blocks(model)[0]
    return adapter, adapter.router(block), block.experts


def library_routing(adapter, router, hidden, spec: BudgetSpec, rows: int = 1):
    """What the router hook hands the experts: natural routing, then ``apply_budget`` over ``spec``'s windows.

    Returns ``(natural_ids (N, k), ids (N, k), weights (N, k), groups (N,))``.
    """
    n = hidden.shape[0]
    with torch.no_grad():
        logits, weights, ids = router(hidden)  # (N, E), (N, k), (N, k)
        positions = torch.arange(n // rows).expand(rows, -1)  # (rows, T)
        groups, n_groups = window_groups(positions, torch.ones_like(positions, dtype=torch.bool), spec)
        groups = groups.reshape(-1)  # (N,)
        b_weights, b_ids = apply_budget(adapter, router, logits, (weights, ids), groups, n_groups, spec.B, spec.policy)
    return ids, b_ids, b_weights, groups


def kernel(experts, hidden, ids, weights, config=SMALL_BLOCKS):
    bias = bool(getattr(experts, "has_bias", False))
    return fused_experts(
        hidden, experts.gate_up_proj, experts.down_proj, ids, weights, layout=experts_layout(experts),
        gate_up_bias=experts.gate_up_proj_bias if bias else None, down_bias=experts.down_proj_bias if bias else None,
        config=config,
    )  # fmt: skip


def reference(experts, hidden, ids, weights):
    bias = bool(getattr(experts, "has_bias", False))
    return fused_experts_reference(
        hidden, experts.gate_up_proj, experts.down_proj, ids, weights, layout=experts_layout(experts),
        gate_up_bias=experts.gate_up_proj_bias if bias else None, down_bias=experts.down_proj_bias if bias else None,
    )  # fmt: skip


def eager(experts, hidden, ids, weights):
    """transformers' eager experts forward on the same routing.

    GPT-OSS's eager forward has no sentinel class (its one-hot spans E), so there a dropped slot is sent to expert 0
    with weight 0 instead — the same sum, since its routing weight multiplies after the down bias.
    """
    if type(experts).__name__ == "GptOssExperts":
        dropped = ids == NUM_EXPERTS
        ids, weights = ids.masked_fill(dropped, 0), weights.masked_fill(dropped, 0.0)
    previous = experts.config._experts_implementation
    experts.config._experts_implementation = "eager"
    try:
        with torch.no_grad():
            return experts(hidden, ids, weights)
    finally:
        experts.config._experts_implementation = previous


def max_pairs_per_expert(ids: torch.Tensor) -> int:
    real = ids[ids < NUM_EXPERTS]
    return int(torch.bincount(real, minlength=NUM_EXPERTS).max()) if real.numel() else 0


def assert_kernel_matches(experts, hidden, ids, weights):
    out = kernel(experts, hidden, ids, weights)
    torch.testing.assert_close(out, reference(experts, hidden, ids, weights), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, eager(experts, hidden, ids, weights), atol=1e-5, rtol=1e-5)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# apply_budget on a real router, one window of 64 tokens (P = 256 pairs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["substitute", "truncate"])
@pytest.mark.parametrize("budget", [2, 6], ids=["B<k", "k<B<union"])
def test_library_budget_binds(family, policy, budget):
    adapter, router, experts = moe_layer(family)
    hidden = torch.randn(64, HIDDEN)  # (N, H) one window of 64 tokens
    natural, ids, weights, _ = library_routing(adapter, router, hidden, BudgetSpec(B=budget, policy=policy))
    assert natural.unique().numel() > budget  # the budget binds
    used = set(ids[ids < NUM_EXPERTS].tolist())
    assert 0 < len(used) <= budget
    if budget < TOP_K:
        assert bool((ids == NUM_EXPERTS).any())  # fewer experts than slots: some slots are dropped
    assert max_pairs_per_expert(ids) > BLOCK_M  # some expert's pair run spans several M-blocks
    with record_experts_read() as calls:
        assert_kernel_matches(experts, hidden, ids, weights)
    assert set(calls[0].experts) == used


@pytest.mark.parametrize("family", FAMILIES)
def test_library_budget_fits_is_natural(family):
    """Windows of 2 tokens (union ≤ 2k = 8) under B = 8 < E: every window fits, routing and output stay natural."""
    adapter, router, experts = moe_layer(family)
    hidden = torch.randn(64, HIDDEN)  # (N, H) 32 windows of 2 tokens
    spec = BudgetSpec(B=2 * TOP_K, policy="truncate", window=2)
    natural, ids, weights, groups = library_routing(adapter, router, hidden, spec)
    assert spec.B < NUM_EXPERTS and groups.unique().numel() == 32
    assert torch.equal(ids, natural)
    assert max_pairs_per_expert(ids) > BLOCK_M
    with torch.no_grad():
        _, natural_weights, _ = router(hidden)
    assert torch.equal(weights, natural_weights)
    assert_kernel_matches(experts, hidden, ids, weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_library_budget_per_window_in_a_batch(family):
    """Two rows × windows of 8 (16 budget sets in one call): at most B experts per window, kernel exact."""
    adapter, router, experts = moe_layer(family)
    hidden = torch.randn(96, HIDDEN)  # (N, H) 2 rows of 48 tokens
    spec = BudgetSpec(B=3, policy="substitute", window=8)
    _, ids, weights, groups = library_routing(adapter, router, hidden, spec, rows=2)
    for g in groups.unique().tolist():
        window_ids = ids[groups == g]
        assert len(set(window_ids[window_ids < NUM_EXPERTS].tolist())) <= spec.B
    assert max_pairs_per_expert(ids) > BLOCK_M
    assert_kernel_matches(experts, hidden, ids, weights)


# ---------------------------------------------------------------------------------------------------------------------
# End to end: load_target(experts_impl="triton") + FrozenTarget.forward(budget=...) against the eager target

@pytest.mark.parametrize("family", FAMILIES)
def test_budgeted_target_forward_through_the_hook(family):
    """One 48-token window (P = 192 pairs per layer): B < k and k < B < union, both policies; logits equal the
    eager target's, executed ids are identical, and each kernel call reads exactly the executed experts."""
    from vat.target import load_target

    input_ids = torch.randint(3, 128, (1, 48))
    specs = [BudgetSpec(B=b, policy=p) for b in (2, 6) for p in ("substitute", "truncate")]
    outputs, calls = {}, []
    for impl in ("eager", "triton"):
        target = load_target(tiny_model(family, num_experts=NUM_EXPERTS, top_k=TOP_K), device="cpu", experts_impl=impl)
        try:
            with record_experts_read() as recorded:
                outputs[impl] = [target.forward(input_ids, budget=spec, output_aux=False) for spec in specs]
            if impl == "eager":
                natural = target.forward(input_ids, output_aux=False).topk_ids  # (L, 1, T, k)
        finally:
            target.close()
        calls += recorded
    n_layers = natural.shape[0]
    assert len(calls) == len(specs) * n_layers  # only the triton target calls the kernel
    assert min(layer.unique().numel() for layer in natural) > 6  # both budgets bind in every layer
    for s, (spec, eager_out, triton_out) in enumerate(zip(specs, outputs["eager"], outputs["triton"])):
        assert torch.equal(triton_out.topk_ids, eager_out.topk_ids)
        torch.testing.assert_close(triton_out.logits, eager_out.logits, atol=1e-5, rtol=0)
        for layer in range(n_layers):
            executed = eager_out.topk_ids[layer]
            real = set(executed[executed < NUM_EXPERTS].tolist())
            assert set(calls[s * n_layers + layer].experts) == real and len(real) <= spec.B
        assert max(max_pairs_per_expert(layer) for layer in eager_out.topk_ids) > BLOCK_M
