"""Family adapters: where each MoE family keeps its router and experts, and its own routing rule.

Every touch point with a model family's internals lives here (docs/bench.md). An adapter answers three questions:

* which modules are the MoE blocks, routers and experts of a model;
* ``scores``: the per-expert scores the budget selection sums over a window (softmax probabilities, or the
  model's own sigmoid scores for DeepSeek-V3);
* ``select``: the model's own top-k selection rule, optionally with some experts excluded from the *ranking*
  (``allowed``), returning ``(topk_weights, topk_ids)`` exactly as the model's router would.

Slots that cannot be filled because fewer than ``top_k`` experts are allowed get the sentinel id ``num_experts``
and weight 0; transformers' experts implementations skip that id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vat.errors import VatError


@dataclass(frozen=True)
class FamilyAdapter:
    """Routing rule and module layout of one MoE family.

    Attributes:
        name: family name (the HF ``model_type`` it serves).
        router_attr: attribute of the MoE block holding the router (``gate`` or ``router``).
        rule: routing rule: ``softmax_topk`` (OLMoE, Qwen2/3-MoE; renormalised iff ``norm_topk_prob``),
            ``softmax_topk_renorm`` (Mixtral: always renormalised, fp32 weights), ``topk_softmax`` (GPT-OSS:
            top-k on logits, softmax over the chosen), ``sigmoid_group`` (DeepSeek-V3: sigmoid + correction bias,
            group-limited top-k, weights from the unbiased scores, optional renorm, routed scaling).
    """

    name: str
    router_attr: str
    rule: str

    # ---- module layout -------------------------------------------------------------------------------------
    def moe_blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(decoder layer index, MoE block) for every MoE layer of ``model``, in layer order."""
        blocks = []
        for idx, layer in enumerate(decoder_layers(model)):
            block = getattr(layer, "mlp", None)
            if block is not None and hasattr(block, "experts") and hasattr(block, self.router_attr):
                blocks.append((idx, block))
        return blocks

    def router(self, block: nn.Module) -> nn.Module:
        return getattr(block, self.router_attr)

    # ---- routing rule --------------------------------------------------------------------------------------
    def scores(self, router: nn.Module, logits: torch.Tensor, rank: str = "weights") -> torch.Tensor:
        """Per-expert routing scores in fp32, summed over a window to pick the budget set.

        Args:
            router: the router module (for its attributes).
            logits: (N, E) router logits as the router returned them.
            rank: ``weights``: the scores that weigh the experts (softmax probabilities; DeepSeek-V3's unbiased
                sigmoid scores), or ``routing``: the scores the tokens rank their experts by, which differ only for
                DeepSeek-V3 (sigmoid + its correction bias; an extension of MoE-Spec, docs/verification_policies.md).

        Returns:
            (N, E) fp32.
        """
        if self.rule == "sigmoid_group":
            scores = logits.float().sigmoid()
            return scores + router.e_score_correction_bias.float() if rank == "routing" else scores
        return torch.softmax(logits.float(), dim=-1)

    def select(
        self, router: nn.Module, logits: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model's own top-k rule with the experts outside ``allowed`` excluded from the ranking.

        Args:
            router: the router module (``top_k``, ``num_experts`` and the family's flags).
            logits: (N, E) router logits.
            allowed: (N, E) bool, or None for the natural routing.

        Returns:
            ``(topk_weights (N, k), topk_ids (N, k) int64)``. Weights come from the model's *unmasked* scores of
            the chosen experts, normalised and scaled as the model does. A slot left without an allowed expert
            holds the sentinel ``num_experts`` with weight 0.
        """
        k, num_experts = router.top_k, router.num_experts
        if self.rule == "sigmoid_group":
            return _select_sigmoid_group(router, logits, allowed)
        if self.rule == "topk_softmax":  # GPT-OSS: rank raw logits, softmax over the chosen
            rank = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
            _, ids = torch.topk(rank, k, dim=-1)  # (N, k)
            ok = _slot_ok(allowed, ids)
            chosen = logits.gather(1, ids).masked_fill(~ok, float("-inf"))
            weights = torch.softmax(chosen, dim=1, dtype=chosen.dtype)
            return _with_sentinel(weights, ids, ok, num_experts)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # (N, E)
        rank = probs if allowed is None else probs.masked_fill(~allowed, -1.0)
        _, ids = torch.topk(rank, k, dim=-1)  # (N, k)
        ok = _slot_ok(allowed, ids)
        weights = probs.gather(1, ids) * ok  # (N, k) fp32
        if self.rule == "softmax_topk_renorm" or getattr(router, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
        if self.rule == "softmax_topk":  # OLMoE / Qwen cast back to the logits dtype; Mixtral keeps fp32
            weights = weights.to(logits.dtype)
        return _with_sentinel(weights, ids, ok, num_experts)


def _slot_ok(allowed: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    if allowed is None:
        return torch.ones_like(ids, dtype=torch.bool)
    return allowed.gather(1, ids)  # (N, k)


def _with_sentinel(weights, ids, ok, num_experts):
    ids = torch.where(ok, ids, torch.full_like(ids, num_experts))
    return weights.masked_fill(~ok, 0.0), ids


def _select_sigmoid_group(router, logits, allowed):
    """DeepSeek-V3's rule (sigmoid, correction bias, group top-2 sums, ``topk_group`` groups, top-k), over ``allowed``.

    With every expert allowed this is exactly the model's router. With some experts excluded (a budget set S), the
    model's procedure runs on S alone:

    1. each group is scored by the sum of its top-2 *allowed* biased scores (a group holding one allowed expert
       scores that expert alone; a group with none cannot be chosen), so a group is never sunk by the experts it
       lost to the budget;
    2. the ``topk_group`` best groups are taken, then, if they hold fewer than ``top_k`` allowed experts, the next
       groups in rank order until they do (or none is left): the group limit never leaves a slot empty while S
       still has an expert for it;
    3. top-k over the allowed experts of the chosen groups; weights from the unbiased scores, renormalised and
       scaled as the model does.

    A slot stays empty (sentinel ``num_experts``, weight 0) only when S holds fewer than ``top_k`` experts.

    Args:
        router: a ``DeepseekV3TopkRouter`` (``top_k``, ``num_experts``, ``num_group``, ``topk_group``,
            ``e_score_correction_bias``, ``norm_topk_prob``, ``routed_scaling_factor``).
        logits: (N, E) router logits.
        allowed: (N, E) bool, or None (all experts).

    Returns:
        ``(topk_weights (N, k) fp32, topk_ids (N, k) int64)``.
    """
    k, num_experts = router.top_k, router.num_experts
    n_group, topk_group = router.num_group, router.topk_group
    size = num_experts // n_group
    scores = logits.float().sigmoid()  # (N, E)
    choice = scores + router.e_score_correction_bias  # (N, E) biased scores rank, unbiased ones weigh
    if allowed is None:
        allowed = torch.ones_like(choice, dtype=torch.bool)
    ranked = choice.masked_fill(~allowed, float("-inf"))  # (N, E)
    top2 = ranked.view(-1, n_group, size).topk(min(2, size), dim=-1)[0]  # (N, G, 2)
    group_scores = top2.masked_fill(top2 == float("-inf"), 0.0).sum(dim=-1)  # (N, G) top-2 of the allowed
    held = allowed.view(-1, n_group, size).sum(dim=-1)  # (N, G) allowed experts per group
    group_scores = group_scores.masked_fill(held == 0, float("-inf"))
    group_mask = _chosen_groups(group_scores, held, topk_group, k)  # (N, G)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, n_group, size).reshape(-1, num_experts)  # (N, E)
    ranked = ranked.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(ranked, k=k, dim=-1, sorted=False)[1]  # (N, k)
    ok = torch.isfinite(ranked.gather(1, ids))  # (N, k) False only when fewer than k experts are allowed
    weights = scores.gather(1, ids) * ok
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * router.routed_scaling_factor
    return _with_sentinel(weights, ids, ok, num_experts)


def _chosen_groups(group_scores: torch.Tensor, held: torch.Tensor, topk_group: int, k: int) -> torch.Tensor:
    """The groups a token routes within: the ``topk_group`` best, widened in rank order until they hold k experts.

    Args:
        group_scores: (N, G) group scores (-inf = no allowed expert).
        held: (N, G) allowed experts per group.
        topk_group: the model's group limit.
        k: top_k.

    Returns:
        (N, G) bool.
    """
    order = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices  # (N, G) best group first
    held_ranked = held.gather(1, order)  # (N, G)
    before = held_ranked.cumsum(dim=-1) - held_ranked  # (N, G) allowed experts in the better groups
    rank = torch.arange(group_scores.shape[-1], device=group_scores.device)  # (G,)
    take = (rank < topk_group) | (before < k)  # (N, G) by rank
    return torch.zeros_like(take).scatter_(1, order, take)


ADAPTERS: dict[str, FamilyAdapter] = {
    "olmoe": FamilyAdapter("olmoe", "gate", "softmax_topk"),
    "qwen3_moe": FamilyAdapter("qwen3_moe", "gate", "softmax_topk"),
    "qwen2_moe": FamilyAdapter("qwen2_moe", "gate", "softmax_topk"),
    "mixtral": FamilyAdapter("mixtral", "gate", "softmax_topk_renorm"),
    "deepseek_v3": FamilyAdapter("deepseek_v3", "gate", "sigmoid_group"),
    "gpt_oss": FamilyAdapter("gpt_oss", "router", "topk_softmax"),
}


def adapter_for(config) -> FamilyAdapter:
    """The adapter of a model config; one clear error for an unsupported family."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise VatError(
            f"unsupported target family `{model_type}`: vat supports {', '.join(sorted(ADAPTERS))} (MoE causal LMs)"
        )
    return ADAPTERS[model_type]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers``)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise VatError(f"cannot find decoder layers in {type(model).__name__} (expected model.model.layers)")
    return layers


def experts_of(block: nn.Module) -> nn.Module:
    return block.experts


def expert_bytes(experts: nn.Module) -> int:
    """Bytes of ONE expert's weights (gate_up + down, biases included), from the fused 3-D parameters."""
    total = 0
    for name, param in experts.named_parameters(recurse=False):
        if param.dim() >= 2 or name.endswith("bias"):
            total += (param.numel() // param.shape[0]) * param.element_size()
    return total
