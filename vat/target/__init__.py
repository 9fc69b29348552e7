"""The frozen MoE target: loading, family adapters, feature + routing capture, expert budgeting, accounting."""

from vat.target.accounting import bytes_per_window, contiguous_windows, window_union
from vat.target.budget import BudgetSpec, apply_budget, budget_sets, window_groups
from vat.target.families import ADAPTERS, FamilyAdapter, adapter_for
from vat.target.model import (
    FrozenTarget,
    TargetOutput,
    default_aux_layer_ids,
    from_vllm_layer_ids,
    load_target,
    to_sglang_capture_slots,
    to_sglang_layer_ids,
    to_vllm_layer_ids,
)

__all__ = [
    "ADAPTERS", "BudgetSpec", "FamilyAdapter", "FrozenTarget", "TargetOutput", "adapter_for", "apply_budget",
    "budget_sets", "bytes_per_window", "contiguous_windows", "default_aux_layer_ids", "from_vllm_layer_ids",
    "load_target", "to_sglang_capture_slots", "to_sglang_layer_ids", "to_vllm_layer_ids", "window_groups",
    "window_union",
]
