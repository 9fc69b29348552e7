"""Router hooks: capture the executed top-k expert ids of every MoE layer, and apply expert budgets.

One forward hook per router (an extension point, not a monkeypatch; handles are removed by :meth:`close`).
The hook sees the router's full output ``(logits, topk_weights, topk_ids)``, so it can rerun the family's own
selection inside a budget set (``substitute``), which an experts implementation alone could not (it receives only
the top-k). What it records is what the experts actually execute: the ids *after* budgeting, never ids recomputed
from ``output_router_logits`` (wrong for DeepSeek-V3's biased, group-limited routing).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from vat.target.budget import BudgetSpec, apply_budget
from vat.target.families import FamilyAdapter


@dataclass
class _ForwardContext:
    budget: BudgetSpec | None = None
    groups: torch.Tensor | None = None  # (N,) window id per flattened token, -1 = unbudgeted
    n_groups: int = 0
    capture: bool = True
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE ordinal -> (N, k)


class RoutingController:
    """Installs one hook per MoE router of ``model`` and runs forwards with capture and budgets.

    Args:
        model: the HF causal LM.
        adapter: its family adapter.
    """

    def __init__(self, model: nn.Module, adapter: FamilyAdapter):
        self.adapter = adapter
        self.moe_layers: list[tuple[int, nn.Module, nn.Module]] = []  # (layer index, router, experts)
        for layer_idx, block in adapter.moe_blocks(model):
            self.moe_layers.append((layer_idx, adapter.router(block), block.experts))
        self._ctx: _ForwardContext | None = None
        self._handles = [
            router.register_forward_hook(self._make_hook(ordinal, layer_idx))
            for ordinal, (layer_idx, router, _) in enumerate(self.moe_layers)
        ]

    def _make_hook(self, ordinal: int, layer_idx: int):
        def hook(router: nn.Module, args, output):
            ctx = self._ctx
            if ctx is None:
                return None
            logits, weights, ids = output
            if ctx.budget is not None and ctx.groups is not None:
                budget = ctx.budget.budget_for(layer_idx, ordinal)
                if budget is not None:
                    weights, ids = apply_budget(
                        self.adapter, router, logits, (weights, ids), ctx.groups, ctx.n_groups, budget,
                        ctx.budget.policy,
                    )
            if ctx.capture:
                ctx.captured[ordinal] = ids.detach()
            return logits, weights, ids

        return hook

    @contextmanager
    def forward_context(
        self,
        groups: torch.Tensor | None = None,
        n_groups: int = 0,
        budget: BudgetSpec | None = None,
        capture: bool = True,
    ):
        """Within this context, every forward of the model is budgeted/captured.

        Args:
            groups: (B*T,) budget-window id of each flattened token (-1 = unbudgeted), or None.
            n_groups: number of windows.
            budget: the budget, or None for natural routing.
            capture: record the executed top-k ids.

        Yields:
            The context; ``ctx.captured`` maps MoE-layer ordinal to (B*T, k) ids after the forward.
        """
        ctx = _ForwardContext(budget=budget, groups=groups, n_groups=n_groups, capture=capture)
        previous, self._ctx = self._ctx, ctx
        try:
            yield ctx
        finally:
            self._ctx = previous

    def stacked(self, ctx: _ForwardContext, batch: int, length: int) -> torch.Tensor | None:
        """Captured ids as ``(L', B, T, k)`` (sentinel ``num_experts`` marks a dropped slot)."""
        if not ctx.captured:
            return None
        ids = [ctx.captured[i] for i in range(len(self.moe_layers))]
        return torch.stack(ids).view(len(ids), batch, length, -1)

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
