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
    natural: dict[int, torch.Tensor] = field(default_factory=dict)  # budgeted MoE ordinal -> (N, k) router's own top-k
    uncovered: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE ordinal -> () tokens with no expert in S
    token_weight: torch.Tensor | None = None  # (N,) AcceptMoE's commitment weight per flattened token
    anchor: torch.Tensor | None = None  # (N,) bool, the root token of each window (AcceptMoE's anchor)
    record_pools: bool = False  # keep each budgeted layer's router logits and allowed sets (Window Pool training)
    pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # ordinal -> (logits, allowed)


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
        # experts forwards that cannot skip the dropped-slot sentinel (GPT-OSS's eager one-hot has no class for it)
        # get the sentinel replaced by one of the token's own kept experts at weight 0: same output, no extra expert
        # loaded; captures and accounting still see the sentinel
        self.fill_dropped_slots = False
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
            if ctx.capture and ctx.budget is not None:  # the router's own choice, before the budget reroutes it
                ctx.natural[ordinal] = ids.detach()
            if ctx.budget is not None and ctx.groups is not None:
                spec = ctx.budget
                budget = None if spec.self_sized else spec.budget_for(layer_idx, ordinal)
                if budget is not None or spec.self_sized:
                    counts: dict[str, torch.Tensor] = {}
                    device = logits.device  # a device_map target runs layers on several GPUs
                    weights, ids = apply_budget(
                        self.adapter, router, logits, (weights, ids), ctx.groups.to(device), ctx.n_groups, budget,
                        spec.policy, counts=counts,
                        token_weight=None if ctx.token_weight is None else ctx.token_weight.to(device),
                        anchor=None if ctx.anchor is None else ctx.anchor.to(device), acceptmoe=spec.acceptmoe,
                        moe_ordinal=ordinal, rank=spec.rank,
                    )
                    if "uncovered" in counts:
                        ctx.uncovered[ordinal] = counts["uncovered"]
                    if ctx.record_pools and "allowed" in counts:
                        ctx.pools[ordinal] = (logits, counts["allowed"])  # (N, E) each; logits keep their graph
            if ctx.capture:
                ctx.captured[ordinal] = ids.detach()
            if self.fill_dropped_slots:
                ids = fill_dropped_slots(ids, router.num_experts)
            return logits, weights, ids

        return hook

    @contextmanager
    def forward_context(
        self,
        groups: torch.Tensor | None = None,
        n_groups: int = 0,
        budget: BudgetSpec | None = None,
        capture: bool = True,
        record_pools: bool = False,
        token_weight: torch.Tensor | None = None,
        anchor: torch.Tensor | None = None,
    ):
        """Within this context, every forward of the model is budgeted/captured.

        Args:
            groups: (B*T,) budget-window id of each flattened token (-1 = unbudgeted), or None.
            n_groups: number of windows.
            budget: the budget, or None for natural routing.
            capture: record the executed top-k ids.
            record_pools: keep ``ctx.pools``: per budgeted MoE layer, its router logits (N, E) and each token's
                allowed set (N, E) bool.
            token_weight: (B*T,) AcceptMoE's commitment weight per token (policy ``acceptmoe``).
            anchor: (B*T,) bool, each window's root token (policy ``acceptmoe``).

        Yields:
            The context; ``ctx.captured`` maps MoE-layer ordinal to (B*T, k) ids after the forward.
        """
        ctx = _ForwardContext(budget=budget, groups=groups, n_groups=n_groups, capture=capture, record_pools=record_pools,
                              token_weight=token_weight, anchor=anchor)
        previous, self._ctx = self._ctx, ctx
        try:
            yield ctx
        finally:
            self._ctx = previous

    def stacked(self, ctx: _ForwardContext, batch: int, length: int) -> torch.Tensor | None:
        """Captured ids as ``(L', B, T, k)`` (sentinel ``num_experts`` marks a dropped slot)."""
        if not ctx.captured:
            return None
        device = ctx.captured[0].device  # layers of a device_map target live on several GPUs
        ids = [ctx.captured[i].to(device) for i in range(len(self.moe_layers))]
        return torch.stack(ids).view(len(ids), batch, length, -1)

    def stacked_natural(self, ctx: _ForwardContext, batch: int, length: int) -> torch.Tensor | None:
        """The routers' own top-k ids in a budgeted forward, before the budget rerouted them, as ``(L', B, T, k)``;
        None when the forward had no budget (the executed ids are then the natural ones).

        Each router reads the residual stream of *this* forward, so at layers after a budgeted one the ids are the
        natural choice given the budgeted stream: equal to an unbudgeted forward's up to and including the first
        budgeted layer (and wherever the budget did not bind), close to it elsewhere.
        """
        if not ctx.natural:
            return None
        device = ctx.natural[0].device
        ids = [ctx.natural[i].to(device) for i in range(len(self.moe_layers))]
        return torch.stack(ids).view(len(ids), batch, length, -1)

    def uncovered(self, ctx: _ForwardContext) -> torch.Tensor | None:
        """(L',) int64: budgeted tokens per MoE layer none of whose natural experts was in the budget set (0 for an
        unbudgeted layer); None when nothing was budgeted."""
        if not ctx.uncovered:
            return None
        zero = next(iter(ctx.uncovered.values())).new_zeros(())
        return torch.stack([ctx.uncovered.get(i, zero).to(zero.device) for i in range(len(self.moe_layers))])

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def fill_dropped_slots(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Replace each dropped slot (sentinel ``num_experts``) by the token's lowest kept expert id; its weight is 0.

    For experts forwards that index a one-hot of width ``num_experts`` (GPT-OSS eager): the slot then adds
    ``0 * expert(x)`` for an expert the token runs anyway, so the output is unchanged and no other expert is read.

    Args:
        ids: (N, k) executed ids, sentinel = dropped.
        num_experts: E.

    Returns:
        (N, k) ids in ``[0, E)``. A row with no kept expert (a token MoE-Spec's ``truncate`` leaves without expert
        output) takes the lowest expert any row keeps, one the forward runs anyway (expert 0 when no row keeps one),
        still at weight 0.
    """
    dropped = ids == num_experts  # (N, k)
    kept_or_e = torch.where(dropped, torch.full_like(ids, num_experts), ids)  # (N, k)
    first_kept = kept_or_e.min(dim=1, keepdim=True).values  # (N, 1)
    any_kept = kept_or_e.min() % num_experts  # () an expert some row runs (0 when none does)
    first_kept = torch.where(first_kept == num_experts, any_kept, first_kept)
    return torch.where(dropped, first_kept.expand_as(ids), ids)
