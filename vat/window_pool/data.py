"""Text for Window Pool: the target's pretraining-style rows to train on, and held-out sequences to measure.

``tiny-pretrain`` is the embedded target's own pretraining text: the training split of its build (ShareGPT, and the
code chats for the bench build: :func:`vat.data_prep.tiny_target.read_training_chats`), rendered with its chat
template and packed into rows of its ``seq_len`` exactly as it was pretrained; ``tiny-heldout`` is that build's held-out conversations (the set its build
report measures perplexity on), never seen by the target nor by Window Pool training. Any other value is a prepared
dataset directory (``vat prep chat``) or the tiny names of :mod:`vat.train.defaults`.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoTokenizer

from vat.data_prep.tiny_target import encode_heldout, pack_conversations, read_training_chats, spec_for
from vat.errors import VatError
from vat.paths import TINY_TARGET_NAMES, tiny_size
from vat.train.data import load_prepared
from vat.train.defaults import TINY_DATA_NAMES, resolve_train_data

PRETRAIN_NAME = "tiny-pretrain"
HELDOUT_NAME = "tiny-heldout"


@dataclass
class TokenRows:
    """Sequences as a list-like of ``{"input_ids", "loss_mask"}`` rows (what :func:`vat.train.data.collate` reads)."""

    ids: list[list[int]]
    masks: list[list[int]]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "loss_mask": self.masks[i]}

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.ids]


def _tiny_split(target_name: str, tokenizer_dir: str):
    """The build's own training conversations (ShareGPT, plus the code chats of a build that mixes them, in the order
    its pretraining packed them) and its held-out ones (chat, then code)."""
    spec = spec_for(tiny_size(target_name))
    train, heldout, _ = read_training_chats(spec)
    heldout_all = [conv for convs in heldout.values() for conv in convs]
    return spec, train, heldout_all, AutoTokenizer.from_pretrained(tokenizer_dir)


def training_rows(name: str, target_path: str, tokenizer_dir: str, max_length: int | None,
                  limit: int | None) -> TokenRows:
    """The rows Window Pool trains on.

    Args:
        name: ``tiny-pretrain``, ``tiny`` / ``tiny-regen``, or a prepared dataset directory.
        target_path: the recipe's ``target.path`` (``tiny-quick`` selects the quick build's text).
        tokenizer_dir: the loaded target's directory (its tokenizer renders the text).
        max_length: longer samples are dropped (prepared data) or rows cut (packed text); None = keep all.
        limit: at most this many rows.

    Returns:
        :class:`TokenRows`; ``loss_mask`` is the data's own (1 everywhere for packed pretraining text).
    """
    if name == PRETRAIN_NAME:
        spec, train, _, tokenizer = _tiny_split(target_path if target_path in TINY_TARGET_NAMES else "tiny", tokenizer_dir)
        rows = pack_conversations(tokenizer, train, spec)[:, :max_length]  # (N, seq_len); [:, :None] keeps all
        if limit is not None:
            rows = rows[:limit]
        ids = rows.tolist()
        return TokenRows(ids, [[1] * len(r) for r in ids])

    if name in TINY_DATA_NAMES:
        name = resolve_train_data(name, target_path if target_path in TINY_TARGET_NAMES else "tiny",
                                  max_length or 1024)
    ds, _ = load_prepared(name, max_length, limit)
    return TokenRows([list(x) for x in ds["input_ids"]], [list(x) for x in ds["loss_mask"]])


def heldout_sequences(name: str, target_path: str, tokenizer_dir: str, max_length: int,
                      limit: int | None) -> TokenRows:
    """Held-out sequences for perplexity.

    Args:
        name: ``tiny-heldout`` (the tiny build's held-out conversations, ``loss_mask`` = assistant tokens) or a
            prepared dataset directory.
        target_path: ``tiny-quick`` selects the quick build's held-out set.
        tokenizer_dir: the target's directory (its chat template).
        max_length: sequences are cut to this many tokens.
        limit: at most this many sequences (the first ones).

    Returns:
        :class:`TokenRows`.
    """
    if name == HELDOUT_NAME:
        _, _, heldout, tokenizer = _tiny_split(target_path if target_path in TINY_TARGET_NAMES else "tiny", tokenizer_dir)
        if limit is not None:
            heldout = heldout[:limit]
        encoded = encode_heldout(tokenizer, heldout, max_length)
        return TokenRows([ids for ids, _ in encoded], [mask for _, mask in encoded])
    rows = training_rows(name, target_path, tokenizer_dir, None, limit)  # held-out text is cut, never dropped
    rows = TokenRows([x[:max_length] for x in rows.ids], [m[:max_length] for m in rows.masks])
    if not rows.ids:
        raise VatError(f"held-out data {name} has no sequence")
    return rows
