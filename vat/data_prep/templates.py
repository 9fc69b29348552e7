"""Render a conversation with the tokenizer's own chat template and mark the assistant tokens (the loss mask).

Two methods, chosen per template:

* ``generation_markers``: the template wraps assistant output in ``{% generation %} ... {% endgeneration %}``; HF's
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` returns the mask (whatever the markers enclose).
* ``render_diff`` (every other template): render the whole conversation once; for each assistant turn j render
  ``messages[:j]`` with the generation prompt. The longest common prefix of that rendering and the full one ends
  where turn j's header ends, so turn j's content is searched only after it (never inside an earlier user turn that
  quotes it). The mask covers the content's characters plus the end-of-turn token right after it (the first
  special token, with only whitespace in between), mapped to tokens through the fast tokenizer's offsets. Templates
  that trim content (Llama-3) or add blocks to the last turn only (Qwen3's empty ``<think>``) are handled because the
  content is located, not assumed.

The known failure of HF's mask on templates without markers (silently all zeros or all ones) cannot happen here: the
markers path is taken only when the template has markers.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER_METHOD = "generation_markers"
DIFF_METHOD = "render_diff"


class TemplateMismatch(Exception):
    """The rendered text does not contain an assistant turn's content where expected (the template rewrote it)."""


@dataclass
class Encoded:
    """One tokenized conversation: ``input_ids`` and ``loss_mask`` have the same length."""

    input_ids: list[int]
    loss_mask: list[int]


def has_generation_markers(template: str | None) -> bool:
    """Whether a Jinja chat template marks assistant output with ``{% generation %}``."""
    if not template:
        return False
    compact = template.replace(" ", "")
    return "{%generation%}" in compact or "{%-generation%}" in compact or "{%generation-%}" in compact


def mask_method(tokenizer) -> str:
    """The masking method used for ``tokenizer``'s chat template (:data:`MARKER_METHOD` or :data:`DIFF_METHOD`)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template")
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    return MARKER_METHOD if has_generation_markers(template) else DIFF_METHOD


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (including added tokens flagged special, e.g. ``<|im_end|>``)."""
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (C-speed slice compares; the usual case is ``b.startswith(a)``)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1] beyond hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assistant_char_spans(tokenizer, messages: list[dict], text: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and locate each assistant turn's content in the rendering (render-difference method).

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``.
        text: the full rendering if already computed.

    Returns:
        ``(text, spans)``: the full rendering and one ``(start, end)`` character span per assistant turn (the
        content as rendered: verbatim, or stripped where the template trims it).

    Raises:
        TemplateMismatch: an assistant turn's content is not found after its header.
    """
    if text is None:
        text = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        raw = message["content"]
        if not raw.strip():
            continue
        header_end = cursor
        if j > 0:
            try:
                prompt = _render(tokenizer, messages[:j], add_generation_prompt=True)
                header_end = max(cursor, _common_prefix_len(prompt, text))
            except Exception:  # a template may refuse a prefix (e.g. strict alternation); fall back to the cursor
                header_end = cursor
        content = raw
        start = text.find(raw, header_end)
        if start < 0:  # templates that trim content (Llama-3's `| trim`)
            content = raw.strip()
            start = text.find(content, header_end)
        if start < 0:
            raise TemplateMismatch(f"assistant turn {j}: content not found in the rendered conversation")
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return text, spans


def mask_from_spans(
    offsets: list[tuple[int, int]], input_ids: list[int], spans: list[tuple[int, int]], text: str, special_ids: set[int]
) -> list[int]:
    """Loss mask over tokens: 1 on tokens overlapping a content span and on the end-of-turn token after each span.

    Args:
        offsets: ``(start, end)`` character offsets per token (fast tokenizer).
        input_ids: token ids (same length).
        spans: sorted, non-overlapping character spans of assistant content.
        text: the rendered text the offsets refer to.
        special_ids: ids that count as an end-of-turn token.

    Returns:
        A list of 0/1 of the same length as ``input_ids``.
    """
    mask = [0] * len(input_ids)
    n = len(input_ids)
    i = 0
    for start, end in spans:
        while i < n and offsets[i][1] <= start:  # tokens entirely before the span
            i += 1
        while i < n and offsets[i][0] < end:  # tokens overlapping the span
            if offsets[i][1] > offsets[i][0]:
                mask[i] = 1
            i += 1
        # The end-of-turn token: the next special token, after nothing but whitespace tokens (masked with it, as
        # the model generates them too).
        k = i
        while k < n and input_ids[k] not in special_ids and not text[offsets[k][0] : offsets[k][1]].strip():
            k += 1
        if k < n and input_ids[k] in special_ids:
            for m in range(i, k + 1):
                mask[m] = 1
            i = k + 1
    return mask


def encode_conversations(tokenizer, conversations: list[list[dict]], method: str | None = None) -> list[Encoded | str]:
    """Tokenize conversations with the chat template and build assistant-only loss masks.

    Args:
        tokenizer: a fast tokenizer (offsets are needed) with a chat template.
        conversations: each ``[{"role", "content"}, ...]`` with roles ``system``/``user``/``assistant``.
        method: force :data:`MARKER_METHOD` or :data:`DIFF_METHOD` (default: from the template).

    Returns:
        One :class:`Encoded` per conversation, or the skip reason (``"template_error"``) where the template failed.
    """
    method = method or mask_method(tokenizer)
    if method == MARKER_METHOD:
        try:  # one batched render + tokenization; a template error anywhere falls back to one at a time
            enc = tokenizer.apply_chat_template(
                conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return [Encoded(list(i), [int(m) for m in a]) for i, a in zip(enc["input_ids"], enc["assistant_masks"])]
        except Exception:
            return [_encode_with_markers(tokenizer, conv) for conv in conversations]
    texts: list[str | None] = []
    spans: list[list[tuple[int, int]] | None] = []
    for conv in conversations:
        try:
            text, conv_spans = assistant_char_spans(tokenizer, conv)
        except Exception:  # template raised, or rewrote the content
            text, conv_spans = None, None
        texts.append(text)
        spans.append(conv_spans)
    good = [i for i, t in enumerate(texts) if t is not None]
    out: list[Encoded | str] = ["template_error"] * len(conversations)
    if not good:
        return out
    enc = tokenizer([texts[i] for i in good], add_special_tokens=False, return_offsets_mapping=True)
    special_ids = special_token_ids(tokenizer)
    for row, i in enumerate(good):
        ids = list(enc["input_ids"][row])
        offsets = [tuple(o) for o in enc["offset_mapping"][row]]
        out[i] = Encoded(ids, mask_from_spans(offsets, ids, spans[i], texts[i], special_ids))
    return out


def _encode_with_markers(tokenizer, conv: list[dict]) -> Encoded | str:
    try:
        enc = tokenizer.apply_chat_template(
            conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, add_generation_prompt=False
        )
    except Exception:
        return "template_error"
    return Encoded(list(enc["input_ids"]), [int(m) for m in enc["assistant_masks"]])
