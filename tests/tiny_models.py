"""Tiny random MoE models of every supported family (2 layers, hidden 64, 8 experts, fixed seeds) for tests."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

FAMILIES = ["olmoe", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"]

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=1,
    pad_token_id=0,
    bos_token_id=2,
    tie_word_embeddings=False,
)


def tiny_config(family: str, num_experts: int = 8, top_k: int = 2, num_layers: int = 2):
    """A small random config of ``family`` (one of :data:`FAMILIES`)."""
    common = dict(_COMMON, num_hidden_layers=num_layers)
    if family == "olmoe":
        return OlmoeConfig(**common, intermediate_size=32, num_experts=num_experts, num_experts_per_tok=top_k)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, head_dim=16, intermediate_size=48, moe_intermediate_size=32, num_experts=num_experts,
            num_experts_per_tok=top_k, norm_topk_prob=True,
        )
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=False,
        )
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=32, num_local_experts=num_experts, num_experts_per_tok=top_k)
    if family == "deepseek_v3":
        return DeepseekV3Config(
            **common, intermediate_size=48, moe_intermediate_size=32, n_routed_experts=num_experts,
            num_experts_per_tok=top_k, n_group=2, topk_group=1, first_k_dense_replace=0, n_shared_experts=1,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if family == "gpt_oss":
        return GptOssConfig(
            **common, head_dim=16, intermediate_size=32, num_local_experts=num_experts, num_experts_per_tok=top_k,
            layer_types=["full_attention"] * num_layers, sliding_window=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    raise ValueError(f"unknown family {family}")


def tiny_model(family: str, seed: int = 0, **kwargs):
    """A random model of ``family`` in fp32 eval mode. Router weights are scaled up so routing is not near-uniform,
    and DeepSeek-V3's correction bias is randomised so tests exercise it."""
    torch.manual_seed(seed)
    config = tiny_config(family, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".gate.weight", ".router.weight")):
                param.normal_(0.0, 0.5)
            if name.endswith(".router.bias"):
                param.normal_(0.0, 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.3)
    return model.eval()
