"""The frozen MoE target: loading, family adapters, feature + routing capture, expert budgeting, accounting."""

from vat.target.accounting import bytes_per_window, contiguous_windows, window_union
from vat.target.budget import BudgetSpec, apply_budget, budget_sets, window_groups
from vat.target.conventions import (
    default_aux_layer_ids,
    sglang_to_vat_aux_ids,
    vat_to_sglang_aux_ids,
    vat_to_vllm_aux_ids,
    vllm_to_vat_aux_ids,
)
from vat.target.families import ADAPTERS, FamilyAdapter, adapter_for
from vat.target.model import FrozenTarget, TargetOutput, load_target

__all__ = [
    "ADAPTERS", "BudgetSpec", "FamilyAdapter", "FrozenTarget", "TargetOutput", "adapter_for", "apply_budget",
    "budget_sets", "bytes_per_window", "contiguous_windows", "default_aux_layer_ids", "load_target",
    "sglang_to_vat_aux_ids", "vat_to_sglang_aux_ids", "vat_to_vllm_aux_ids", "vllm_to_vat_aux_ids", "window_groups",
    "window_union",
]
