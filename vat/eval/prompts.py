"""Render benchmark turns with the target tokenizer's chat template, feeding the model's own answers back.

Turn t's prompt is the chat ``[user_1, assistant_1, ..., user_t]`` rendered with ``add_generation_prompt``, where
``assistant_i`` is the text this very configuration generated for turn i (so a budgeted or sampled run continues its
own conversation). Tokenizers without a chat template get the turns joined by blank lines.
"""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered for generation (the assistant's turn opened).

    Args:
        tokenizer: a transformers tokenizer.
        messages: ``[{"role": "user" | "assistant", "content": str}, ...]`` ending with a user turn.

    Returns:
        The prompt's token ids.
    """
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
            rendered = rendered["input_ids"]
        return [int(t) for t in rendered]
    text = "\n\n".join(m["content"] for m in messages)
    return [int(t) for t in tokenizer(text)["input_ids"]]


def decode(tokenizer: Any, token_ids: list[int]) -> str:
    """Text of generated ids, special tokens (EOS) removed."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """Every token that ends generation: the tokenizer's EOS and the model config's / generation config's
    ``eos_token_id``."""
    ids: set[int] = set()
    for source in (tokenizer, getattr(model, "config", None), getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return sorted(ids)
