"""Tiny random MoE models of every supported family (2 layers, hidden 64, 8 experts, fixed seeds) for tests."""

from __future__ import annotations

import weakref

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


def tiny_config(
    family: str, num_experts: int = 8, top_k: int = 2, num_layers: int = 2, vocab_size: int = 128, hidden_size: int = 64
):
    """A small random config of ``family`` (one of :data:`FAMILIES`)."""
    common = dict(_COMMON, num_hidden_layers=num_layers, vocab_size=vocab_size, hidden_size=hidden_size)
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
    return randomized_routing(AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), dtype=torch.float32))


def randomized_routing(model):
    """``model`` in eval mode with its router weights (and biases) redrawn at std 0.5 and DeepSeek-V3's correction
    bias at std 0.3, from the global torch RNG (as :func:`tiny_model` leaves every tiny model)."""
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


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 384):
    """A small byte-level BPE tokenizer with a ChatML template (generation markers) and a MASK token, trained
    on a few sentences in memory; ids fit a model with ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|mask|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "Speculative decoding drafts tokens and the target verifies them in one pass.",
        "Mixture of experts models route every token to a few experts per layer.",
        "def add(a, b):\n    return a + b\n",
        "Translate the following sentence into German: the weather is nice today.",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token="<|endoftext|>",
        mask_token="<|mask|>", chat_template=CHATML_TEMPLATE,
    )
    return wrapped


def save_tiny_target(path, family: str = "olmoe", seed: int = 0, **kwargs) -> str:
    """Save a tiny random model of ``family`` plus :func:`tiny_tokenizer` to ``path`` (a from_pretrained dir)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(family, seed=seed, vocab_size=len(tokenizer), **kwargs)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy decode of ``n`` tokens after ``prompt``: a plain loop of full forwards (no cache), the
    reference every speculative decode must reproduce token for token."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            out.append(token)
    return out


_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(prompt, n): its greedy decode}


def cached_greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """:func:`greedy_reference`, computed once per (model, prompt, n) while ``model`` lives: for tests that compare
    many decodes of one model (never changed in between) with it."""
    per_model = _GREEDY.setdefault(model, {})
    key = (tuple(prompt), n)
    if key not in per_model:
        per_model[key] = greedy_reference(model, prompt, n)
    return per_model[key]
