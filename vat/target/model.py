"""The frozen MoE target: load any supported transformers-5 MoE causal LM and run captured, budgeted forwards.

One forward gives the logits, the hidden states after the requested aux layers (vat's convention: 0-indexed
layer *outputs*), the final hidden state, and the executed top-k expert ids of every MoE layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from vat.data_prep import tiny_target
from vat.errors import VatError
from vat.paths import TINY_TARGET_NAMES
from vat.target.budget import BudgetSpec, commitment_weights, window_groups
from vat.target.cache import cache_kwargs, output_cache
from vat.target.conventions import default_aux_layer_ids
from vat.target.families import FamilyAdapter, adapter_for, decoder_layers, expert_bytes
from vat.target.routing import RoutingController

EXPERTS_IMPLS = ("eager", "grouped_mm", "batched_mm", "triton")


@dataclass
class TargetOutput:
    """What one target forward returns.

    Attributes:
        logits: (B, T, V) next-token logits.
        aux_hidden: (B, T, n_aux * H) hidden states after the aux layers, concatenated in ``aux_layer_ids`` order.
        final_hidden: (B, T, H) the last hidden state after the final norm (what the LM head reads).
        last_hidden: (B, T, H) the last decoder layer's output, the final norm's input (what a capture stores:
            ``logits = lm_head(final_norm(last_hidden))``).
        topk_ids: (L', B, T, k) executed expert ids per MoE layer; ``num_experts`` marks a dropped slot.
        natural_topk_ids: (L', B, T, k) when a budget was applied: each router's own top-k before the budget rerouted
            it (:meth:`RoutingController.stacked_natural`); None without a budget (``topk_ids`` are then natural).
        window_groups: (B, T) budget-window id per token (-1 = unbudgeted), when a budget was applied.
        n_windows: number of budget windows.
        past_key_values: the KV cache when ``use_cache``.
        n_uncovered: (L',) int64, when a budget was applied: budgeted tokens per MoE layer none of whose natural
            top-k experts was in the window's budget set (``truncate`` leaves them with no expert output,
            ``truncate_cover`` substitutes them; ``substitute`` reroutes them as any other). On the target's device, no sync.
    """

    logits: torch.Tensor
    aux_hidden: torch.Tensor | None
    final_hidden: torch.Tensor | None
    topk_ids: torch.Tensor | None
    window_groups: torch.Tensor | None = None
    n_windows: int = 0
    past_key_values: Any = None
    n_uncovered: torch.Tensor | None = None
    natural_topk_ids: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise VatError(f"unknown dtype `{dtype}`: one of auto, {', '.join(table)}")
    return table[dtype]


class FrozenTarget(nn.Module):
    """A frozen MoE causal LM with routing capture and expert budgeting.

    Args:
        model: a transformers MoE causal LM (put in eval mode, gradients off).
        aux_layer_ids: 0-indexed layer outputs to capture; None = EAGLE-3 default ``[1, L//2-1, L-4]``.
        path: where it was loaded from (recorded in draft configs).
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None, path: str | None = None):
        super().__init__()
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.config = model.config
        self.path = path
        self.adapter: FamilyAdapter = adapter_for(self.config)
        self.num_layers = len(decoder_layers(model))
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(self.num_layers)
        for i in self.aux_layer_ids:
            if not 0 <= i < self.num_layers:
                raise VatError(f"aux layer id {i} out of range for a target with {self.num_layers} layers")
        self.routing = RoutingController(model, self.adapter)
        if not self.routing.moe_layers:
            raise VatError(f"{type(model).__name__} has no MoE layers that vat recognises")
        first_router = self.routing.moe_layers[0][1]
        self.num_experts: int = int(first_router.num_experts)
        self.top_k: int = int(first_router.top_k)
        self.moe_layer_ids: list[int] = [layer for layer, _, _ in self.routing.moe_layers]
        self.experts_impl: str | None = None  # set by set_experts_impl (load_target); None = as the model came

    def set_experts_impl(self, experts_impl: str) -> None:
        """Run every MoE layer's experts with ``experts_impl`` (``eager`` | ``grouped_mm`` | ``batched_mm`` |
        ``triton``), through transformers' ``ExpertsInterface``; recorded in ``self.experts_impl``."""
        self.routing.fill_dropped_slots = set_experts_implementation(self.model, experts_impl)
        self.experts_impl = experts_impl

    # ---- shapes and facts ------------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def final_norm(self) -> nn.Module | None:
        """The norm between the last decoder layer and the LM head (None if the model has none where vat looks)."""
        return getattr(getattr(self.model, "model", self.model), "norm", None)

    def expert_bytes_per_layer(self) -> list[int]:
        """Bytes of one expert's weights in each MoE layer (from the weights' shapes and dtype)."""
        return [expert_bytes(experts) for _, _, experts in self.routing.moe_layers]

    # ---- forward ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        budget: BudgetSpec | None = None,
        capture_routing: bool = True,
        output_aux: bool = True,
        logits_to_keep: int = 0,
    ) -> TargetOutput:
        """Run the target once.

        Args:
            input_ids: (B, T) token ids.
            attention_mask: (B, T_past + T) 0/1 mask, or a 4-D additive mask (tree verification), or None.
            position_ids: (B, T) absolute positions; default ``past_length + arange(T)``. Budget windows follow them.
            token_mask: (B, T) bool of real tokens for budget windows; default from a 2-D attention mask.
            past_key_values: a transformers cache to extend.
            use_cache: return the cache.
            budget: expert budget for this forward (None = natural routing).
            capture_routing: record the executed top-k ids of every MoE layer.
            output_aux: return the aux-layer and final hidden states.
            logits_to_keep: keep only the last N positions' logits (0 = all).

        Returns:
            A :class:`TargetOutput`.
        """
        batch, length = input_ids.shape
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + length, device=input_ids.device).expand(batch, -1)
        if token_mask is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                token_mask = attention_mask[:, -length:].bool()
            else:
                token_mask = torch.ones(batch, length, dtype=torch.bool, device=input_ids.device)
        groups, n_groups, weight, anchor = None, 0, None, None
        if budget is not None:
            groups, n_groups = window_groups(position_ids, token_mask, budget)
            if budget.policy == "acceptmoe":  # AcceptMoE weighs each token by its depth in its window
                weight, anchor = commitment_weights(position_ids.reshape(-1), groups.reshape(-1), n_groups,
                                                    budget.acceptmoe)
        kwargs: dict[str, Any] = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=use_cache, logits_to_keep=logits_to_keep,
        )
        kwargs.update(cache_kwargs(self.model, past_key_values))  # transformers' cache keyword (vat/target/cache.py)
        captured: dict[str, torch.Tensor] = {}
        hooks = self._feature_hooks(captured) if output_aux else []
        try:
            with self.routing.forward_context(
                groups.reshape(-1) if groups is not None else None, n_groups, budget, capture_routing,
                token_weight=weight, anchor=anchor,
            ) as ctx:
                out = self.model(**kwargs)
        finally:
            for handle in hooks:
                handle.remove()
        aux = final = last = None
        if output_aux:
            aux = torch.cat([captured[f"layer{i}"] for i in self.aux_layer_ids], dim=-1)  # (B, T, n_aux * H)
            final, last = captured.get("final"), captured.get("last")  # (B, T, H) each
        topk_ids = self.routing.stacked(ctx, batch, length) if capture_routing else None
        natural_ids = self.routing.stacked_natural(ctx, batch, length) if capture_routing else None
        return TargetOutput(
            logits=out.logits, aux_hidden=aux, final_hidden=final, topk_ids=topk_ids, window_groups=groups,
            n_windows=n_groups, past_key_values=output_cache(out) if use_cache else None,
            n_uncovered=self.routing.uncovered(ctx) if budget is not None else None, natural_topk_ids=natural_ids,
            last_hidden=last,
        )

    def _feature_hooks(self, captured: dict[str, torch.Tensor]) -> list:
        """Hooks recording the output of each aux layer (pre-norm, even for the last layer), the final norm's input
        (``last``) and its output (``final``)."""

        def keep(name):
            def hook(module, args, output):
                captured[name] = output[0] if isinstance(output, tuple) else output

            return hook

        def keep_input(module, args):
            captured["last"] = args[0]

        layers = decoder_layers(self.model)
        handles = [layers[i].register_forward_hook(keep(f"layer{i}")) for i in sorted(set(self.aux_layer_ids))]
        norm = self.final_norm()
        if norm is not None:
            handles.append(norm.register_forward_hook(keep("final")))
            handles.append(norm.register_forward_pre_hook(keep_input))
        return handles

    def close(self) -> None:
        """Remove the router hooks (the model returns to its plain behaviour)."""
        self.routing.close()


def load_target(
    path_or_model: str | nn.Module | Any,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    experts_impl: str = "grouped_mm",
    aux_layer_ids: list[int] | None = None,
    device_map: str | None = None,
) -> FrozenTarget:
    """Load a frozen MoE target.

    Args:
        path_or_model: a local directory or hub name for ``from_pretrained``; ``tiny`` / ``tiny-quick`` for the
            embedded default (built on first use); a ``PretrainedConfig`` (random weights, for tests); or an
            already-loaded model.
        dtype: ``auto`` (bf16 on GPU, fp32 on CPU), ``float32``, ``bfloat16`` or ``float16``.
        device: where to put it (default: CUDA if available, else CPU). Ignored with ``device_map``.
        experts_impl: ``eager`` | ``grouped_mm`` | ``batched_mm`` | ``triton`` (vat's budget-aware kernel).
        aux_layer_ids: 0-indexed layer outputs to capture (default EAGLE-3's).
        device_map: e.g. ``auto`` to shard a large target across the GPUs of a node.

    Returns:
        A :class:`FrozenTarget`.
    """
    if experts_impl not in EXPERTS_IMPLS:
        raise VatError(f"unknown experts implementation `{experts_impl}`: one of {', '.join(EXPERTS_IMPLS)}")
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = _resolve_dtype(dtype, device)
    path = None
    if isinstance(path_or_model, nn.Module):
        model = path_or_model
    elif isinstance(path_or_model, PretrainedConfig):
        model = AutoModelForCausalLM.from_config(path_or_model, dtype=torch_dtype)
    else:
        path = resolve_target_path(str(path_or_model))
        if os.path.sep in path and not os.path.exists(path):
            raise VatError(f"target not found: {path}")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, device_map=device_map, local_files_only=os.path.isdir(path) or None
            )
        except OSError as err:
            raise VatError(f"cannot load target `{path}`: {str(err).splitlines()[0]}") from None
    if device_map is None and not isinstance(path_or_model, nn.Module):
        model = model.to(device)
    target = FrozenTarget(model, aux_layer_ids=aux_layer_ids, path=path)
    target.set_experts_impl(experts_impl)
    return target


# transformers' batched experts forwards (grouped_mm, batched_mm) skip the dropped-slot sentinel only when this
# private flag of every ``@use_experts_implementation`` module is set (it marks expert parallelism); vat sets it and
# refuses to load when the installed transformers lacks it (tests/test_budget_semantics.py checks its behaviour)
EXPERT_PARALLEL_FLAG = "_is_expert_parallel"


def set_experts_implementation(model: nn.Module, experts_impl: str) -> bool:
    """Switch the experts forward of every MoE layer through transformers' ``ExpertsInterface``.

    Dropped budget slots carry the sentinel id ``num_experts`` (weight 0). ``triton`` and every family's ``eager``
    skip it; ``grouped_mm``/``batched_mm`` skip it once :data:`EXPERT_PARALLEL_FLAG` is set; GPT-OSS's ``eager``
    cannot (its one-hot has no class for the sentinel), so its router hook fills dropped slots with a kept expert
    at weight 0 instead (:func:`vat.target.routing.fill_dropped_slots`): the output is the same and ``eager`` really
    runs, never swapped for another implementation.

    Args:
        model: the HF MoE causal LM.
        experts_impl: ``eager`` | ``grouped_mm`` | ``batched_mm`` | ``triton``.

    Returns:
        Whether the router hooks must fill dropped slots (GPT-OSS ``eager``).
    """
    if experts_impl not in EXPERTS_IMPLS:
        raise VatError(f"unknown experts implementation `{experts_impl}`: one of {', '.join(EXPERTS_IMPLS)}")
    name = experts_impl
    if experts_impl == "triton":
        from vat.kernels import check_triton_experts_supported, register_triton_experts

        name = register_triton_experts()
        check_triton_experts_supported(model)  # one clear line for a layout the kernel does not cover
    model.set_experts_implementation(name)
    if name in ("grouped_mm", "batched_mm"):
        _mask_sentinels(model, experts_impl)
    return name == "eager" and model.config.model_type == "gpt_oss"


def _mask_sentinels(model: nn.Module, experts_impl: str) -> None:
    """Set :data:`EXPERT_PARALLEL_FLAG` on every experts module, or refuse in one line if transformers lacks it."""
    experts = [block.experts for _, block in adapter_for(model.config).moe_blocks(model)]
    missing = [type(e).__name__ for e in experts if not hasattr(e, EXPERT_PARALLEL_FLAG)]
    if missing:
        raise VatError(
            f"experts_impl {experts_impl}: transformers {transformers.__version__} has no `{EXPERT_PARALLEL_FLAG}` "
            f"on {missing[0]}, so budget-dropped slots would not be skipped; use experts_impl eager or triton"
        )
    for module in experts:
        setattr(module, EXPERT_PARALLEL_FLAG, True)


def resolve_target_path(path: str) -> str:
    """``tiny`` / ``tiny-quick`` / ``tiny-bench`` -> the embedded target's directory (built on first use); other paths
    unchanged."""
    return tiny_target.ensure_tiny_target(TINY_TARGET_NAMES[path]) if path in TINY_TARGET_NAMES else path
