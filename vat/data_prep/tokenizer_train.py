"""Train the embedded tiny target's byte-level BPE tokenizer and wrap it as a transformers fast tokenizer.

The tokenizer is a GPT-2-style byte-level BPE (HF ``tokenizers``) with five special tokens and a ChatML chat
template whose assistant turns are wrapped in ``{% generation %}`` markers, so that
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly each assistant reply plus its
``<|im_end|>`` (the tokens a draft is trained on).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"  # separates packed documents
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a turn; the model's eos
PAD = "<|pad|>"
MASK = "<|mask|>"  # the MASK token DFlash drafts with
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD, MASK]  # ids 0..4, in this order

# ChatML. The generation span covers an assistant reply and its <|im_end|> but not the "\n" after it, so the
# assistant mask is exactly what the model must emit to answer and stop.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (deterministic for a given input order).

    Args:
        texts: training text, e.g. the message contents of the training conversations.
        vocab_size: total vocabulary size, including the 256 byte symbols and :data:`SPECIAL_TOKENS`.
        min_frequency: a pair must occur this often to be merged.

    Returns:
        A raw ``tokenizers.Tokenizer`` with the special tokens at ids ``0..len(SPECIAL_TOKENS)-1``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable: no unknown token
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """Wrap a trained BPE as a transformers fast tokenizer with the ChatML template and named special tokens.

    eos = ``<|im_end|>`` (generation stops at the end of the assistant turn), pad = ``<|pad|>``,
    mask = ``<|mask|>``; there is no BOS (ChatML needs none) and no unknown token (byte-level).
    """
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[ENDOFTEXT, IM_START],
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on ``texts`` and return it wrapped (see :func:`train_bpe`, :func:`wrap_tokenizer`)."""
    return wrap_tokenizer(train_bpe(texts, vocab_size), model_max_length)
