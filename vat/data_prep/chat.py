"""`vat prep chat`: chats (ShareGPT / OpenAI messages / UltraChat) -> ``input_ids`` + assistant-only ``loss_mask``.

Pipeline: stream raw rows (:func:`vat.data_prep.readers.iter_records`, or ``datasets.load_dataset`` for a hub name)
-> normalise each row to ``[{"role", "content"}]`` in the main process (bad rows are counted by reason, never
raised) -> ``Dataset.from_generator`` -> ``.map(num_proc=N)`` renders with the tokenizer's chat template and builds
the mask (:mod:`vat.data_prep.templates`) -> over-length rows dropped -> ``save_to_disk(DIR)`` + ``DIR/stats.json``.

Output columns: ``input_ids`` (list[int32]), ``loss_mask`` (list[int8]: 1 on assistant content tokens and the
assistant end-of-turn token), ``length`` (int32), ``id`` (str). ``stats.json`` satisfies
``rows_read == rows_kept + sum(skipped.values())``.

An assistant turn flagged ``"truncated": true`` (``vat prep regen`` writes it for a reply cut at its token budget)
keeps its content in the loss but not its end-of-turn token, nor any template token the mask would continue with:
the target never produced them (:func:`unsupervise_truncated_ends`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import datasets
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from vat.data_prep.readers import ReadStats, iter_records
from vat.data_prep.templates import Encoded, assistant_char_spans, encode_conversations, mask_method
from vat.errors import VatError, require_file

logger = logging.getLogger(__name__)

SKIP_REASONS = (
    "malformed_json",
    "unknown_format",
    "unknown_role",
    "non_string_content",
    "empty_turn",
    "no_assistant_turn",
    "template_error",
    "empty_loss_mask",
    "over_length",
)

USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "chatgpt", "bard", "bing", "assistant", "model", "claude"}
SYSTEM_ROLES = {"system"}


def _role(name) -> str | None:
    if not isinstance(name, str):
        return None
    name = name.strip().lower()
    if name in USER_ROLES:
        return "user"
    if name in ASSISTANT_ROLES:
        return "assistant"
    if name in SYSTEM_ROLES:
        return "system"
    return None


def _content(value):
    """Message content as a string, or ``None``. OpenAI content parts are accepted when all of them are text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        texts = [p.get("text") for p in value]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None


def detect_layout(record: dict, fmt: str = "auto") -> str | None:
    """``"sharegpt"`` (``conversations``), ``"messages"`` (``messages``), ``"ultrachat"`` (``data`` strings) or None."""
    if fmt in ("auto", "sharegpt") and isinstance(record.get("conversations"), list):
        return "sharegpt"
    if fmt in ("auto", "messages") and isinstance(record.get("messages"), list):
        return "messages"
    if fmt == "auto" and isinstance(record.get("data"), list):
        return "ultrachat"
    return None


def normalize_record(record: dict, fmt: str = "auto") -> tuple[list[dict] | None, str | None, dict]:
    """Turn one raw row into ``[{"role": system|user|assistant, "content": str}]``.

    Leading assistant turns (ShareGPT rows that start mid-conversation) and trailing non-assistant turns (no loss
    on them) are dropped and counted in the returned info; anything else wrong rejects the whole row. An assistant
    turn with ``"truncated": true`` keeps that key (its end-of-turn token gets no loss).

    Args:
        record: a raw row in ShareGPT, OpenAI ``messages`` or UltraChat layout.
        fmt: ``"auto"``, ``"sharegpt"`` or ``"messages"``.

    Returns:
        ``(messages, None, info)`` for a usable row, ``(None, reason, info)`` otherwise, with ``reason`` one of
        :data:`SKIP_REASONS` and ``info`` counts of dropped leading/trailing turns.
    """
    info = {"dropped_leading_turns": 0, "dropped_trailing_turns": 0}
    layout = detect_layout(record, fmt)
    if layout is None:
        return None, "unknown_format", info
    messages: list[dict] = []
    if layout == "ultrachat":
        for i, value in enumerate(record["data"]):
            content = _content(value)
            if content is None:
                return None, "non_string_content", info
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    else:
        role_key, content_key = ("from", "value") if layout == "sharegpt" else ("role", "content")
        for turn in record["conversations" if layout == "sharegpt" else "messages"]:
            if not isinstance(turn, dict):
                return None, "unknown_format", info
            role = _role(turn.get(role_key))
            if role is None:
                return None, "unknown_role", info
            content = _content(turn.get(content_key))
            if content is None:
                return None, "non_string_content", info
            messages.append({"role": role, "content": content})
            if role == "assistant" and turn.get("truncated") is True:
                messages[-1]["truncated"] = True  # cut at a token budget: no end-of-turn supervision
    if any(not m["content"].strip() for m in messages):
        return None, "empty_turn", info
    # Drop leading assistant turns after the optional system prompt: the first turn the model answers is a user's.
    head = 1 if messages and messages[0]["role"] == "system" else 0
    while len(messages) > head and messages[head]["role"] == "assistant":
        messages.pop(head)
        info["dropped_leading_turns"] += 1
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
        info["dropped_trailing_turns"] += 1
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant_turn", info
    return messages, None, info


def load_hub_rows(name: str, split: str = "train", **load_kwargs):
    """A ``datasets`` dataset to iterate over (hub name, or a builder such as ``"json"`` with ``data_files=``).

    Raises:
        VatError: the dataset cannot be loaded (e.g. offline and not cached).
    """
    try:
        return datasets.load_dataset(name, split=split, **load_kwargs)
    except Exception as err:  # offline, unknown name, bad split: one clear line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VatError(f"could not load dataset {name!r} (split {split!r}): {first}") from None


def unsupervise_truncated_ends(tokenizer, conv: list[dict], enc, truncated: set[int]):
    """Zero the loss mask after the content of each truncated assistant turn.

    A turn cut at the generation budget ends without an end-of-turn token from the target, so the end-of-turn
    token the template renders after it (and whatever template tokens the masked run continues with, e.g. a
    ``{% generation %}`` span's tail) must not be trained on. The content is located with the render-difference
    search (:func:`vat.data_prep.templates.assistant_char_spans`, any template); tokens from the first one starting
    at or after the content's end are unmasked up to the end of that masked run.

    Args:
        tokenizer: the fast tokenizer ``enc`` was built with.
        conv: ``[{"role", "content"}]`` as encoded.
        enc: its :class:`~vat.data_prep.templates.Encoded`.
        truncated: indices into ``conv`` of the truncated assistant turns.

    Returns:
        A new ``Encoded``, or ``"template_error"`` if the rendering cannot be matched to ``enc``'s tokens.
    """
    try:
        text, spans = assistant_char_spans(tokenizer, conv)
    except Exception:
        return "template_error"
    # verbose=False: conversations past model_max_length are expected here (the caller cuts them to max_length)
    tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    if list(tokens["input_ids"]) != list(enc.input_ids):  # the mask's tokens are not this rendering's
        return "template_error"
    offsets = tokens["offset_mapping"]
    mask = list(enc.loss_mask)
    located = [j for j, m in enumerate(conv) if m["role"] == "assistant" and m["content"].strip()]
    for j, (_, end) in zip(located, spans):
        if j not in truncated:
            continue
        k = next((k for k, (start, _) in enumerate(offsets) if start >= end), len(mask))
        while k < len(mask) and mask[k]:
            mask[k] = 0
            k += 1
    return Encoded(enc.input_ids, mask)


def _tokenize_batch(batch: dict, tokenizer, method: str, max_length: int) -> dict:
    """``datasets.map`` function: messages -> input_ids, loss_mask, length, skip (reason or "")."""
    convs = [[{"role": t["role"], "content": t["content"]} for t in m] for m in batch["messages"]]
    encoded = encode_conversations(tokenizer, convs, method)
    for i, m in enumerate(batch["messages"]):
        truncated = {j for j, t in enumerate(m) if t.get("truncated")}
        if truncated and isinstance(encoded[i], Encoded):
            encoded[i] = unsupervise_truncated_ends(tokenizer, convs[i], encoded[i], truncated)
    out = {"id": batch["id"], "input_ids": [], "loss_mask": [], "length": [], "skip": []}
    for enc in encoded:
        reason = ""
        if not isinstance(enc, Encoded):
            reason, enc = enc, Encoded([], [])
        elif not any(enc.loss_mask):
            reason = "empty_loss_mask"
        elif len(enc.input_ids) > max_length:
            reason = "over_length"
        if reason:  # keep skipped rows small: only the reason is needed
            enc = Encoded([], [])
        out["input_ids"].append(enc.input_ids)
        out["loss_mask"].append(enc.loss_mask)
        out["length"].append(len(enc.input_ids))
        out["skip"].append(reason)
    return out


def load_tokenizer(path: str):
    """Load a fast tokenizer with a chat template; a :class:`VatError` if it is missing or unusable."""
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise VatError(f"could not load tokenizer from {path!r}: {str(err).strip().splitlines()[0]}") from None
    if not getattr(tok, "is_fast", False):
        raise VatError(f"tokenizer at {path!r} is not a fast tokenizer (character offsets are needed for the masks)")
    if not getattr(tok, "chat_template", None):
        raise VatError(f"tokenizer at {path!r} has no chat template")
    return tok


def _is_file_input(spec: str) -> bool:
    """A local file (existing, or clearly meant as one), as opposed to a ``datasets`` hub name."""
    if spec.startswith("hf:"):
        return False
    if os.path.exists(spec):
        return True
    return spec.startswith((".", "/", "~")) or spec.endswith((".json", ".jsonl", ".gz"))


def _check_output(path: str) -> None:
    """Refuse to overwrite anything but an earlier prepared dataset (replaced only once the new one is written)."""
    if os.path.isdir(path) and os.listdir(path):
        if not os.path.exists(os.path.join(path, "dataset_info.json")):
            raise VatError(f"output directory exists and is not a prepared dataset (refusing to overwrite): {path}")
    elif os.path.exists(path) and not os.path.isdir(path):
        raise VatError(f"output path exists and is a file: {path}")


def prepare_chat(
    input: str,
    tokenizer,
    output: str,
    fmt: str = "auto",
    max_length: int = 2048,
    num_proc: int = 1,
    limit: int | None = None,
    hub_kwargs: dict | None = None,
    progress: bool = True,
) -> dict:
    """Tokenize a chat file (or hub dataset) into ``output`` (``save_to_disk``) and write ``output/stats.json``.

    Args:
        input: JSON array / JSON Lines file (``.gz`` allowed), or a ``datasets`` name (optionally ``name:split``).
        tokenizer: a tokenizer object or path (fast, with a chat template).
        output: output directory.
        fmt: ``"auto"``, ``"sharegpt"`` or ``"messages"``.
        max_length: rows with more tokens are skipped (``over_length``).
        num_proc: processes for ``datasets.map``.
        limit: read at most this many rows.
        hub_kwargs: extra ``load_dataset`` arguments (e.g. ``data_files``) when ``input`` is not a file.
        progress: show tqdm bars.

    Returns:
        The stats dict written to ``stats.json``.
    """
    t0 = time.time()
    tok_path = tokenizer if isinstance(tokenizer, str) else getattr(tokenizer, "name_or_path", None)
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    method = mask_method(tokenizer)
    _check_output(output)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    read = ReadStats()
    records, source = _open_records(input, read, hub_kwargs)
    counts = _RowCounts()
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".vat-prep-", dir=parent)
    try:
        if not progress:
            datasets.disable_progress_bars()
        raw = _conversations_dataset(
            lambda: _usable_rows(records, fmt, limit, read, counts, progress), work, input, counts
        )
        tokenized = _tokenize_dataset(raw, tokenizer, method, max_length, num_proc)
        skip_col = tokenized["skip"] if len(tokenized) else []
        counts.skipped.update(Counter(r for r in skip_col if r))
        final = tokenized.filter(lambda s: [not x for x in s], input_columns=["skip"], batched=True, batch_size=1000)
        final = final.remove_columns(["skip"]).select_columns(["input_ids", "loss_mask", "length", "id"])
        _save_replacing(final, output)
        tokens = int(sum(final["length"])) if len(final) else 0
        loss_tokens = _count_loss_tokens(final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not progress:
            datasets.enable_progress_bars()

    stats = _chat_stats(
        input, source, tok_path, method, max_length, num_proc, read, counts, len(final), tokens, loss_tokens, t0
    )
    with open(os.path.join(output, "stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    return stats


@dataclass
class _RowCounts:
    """What :func:`_usable_rows` counted (the reader's own malformed values are in its :class:`ReadStats`)."""

    skipped: Counter = field(default_factory=lambda: Counter({r: 0 for r in SKIP_REASONS}))  # rows by skip reason
    layouts: Counter = field(default_factory=Counter)  # rows by detected layout ("unknown" when none)
    info: Counter = field(default_factory=Counter)  # dropped leading / trailing turns
    rows: int = 0  # rows that reached normalisation


def _open_records(input: str, read: ReadStats, hub_kwargs: dict | None) -> tuple[Iterator, str]:
    """The raw rows of a chat file (filling ``read``) or of a ``datasets`` name (``[hf:]name[:split]``), and the
    source kind: ``"file"`` or ``"datasets"``."""
    if _is_file_input(input):
        require_file(input, "input file")
        return iter_records(input, read), "file"
    name, _, split = input.removeprefix("hf:").partition(":")
    return iter(load_hub_rows(name, split or "train", **(hub_kwargs or {}))), "datasets"


def _usable_rows(
    records: Iterator, fmt: str, limit: int | None, read: ReadStats, counts: _RowCounts, progress: bool
) -> Iterator[dict]:
    """``{"id", "messages"}`` of every row that normalises (:func:`normalize_record`), the others counted by reason in
    ``counts``; stops after ``limit`` rows read (the reader's malformed values included)."""
    bar = tqdm(desc="read", unit=" rows", disable=not progress)
    for index, record in enumerate(records):
        bar.update(1)
        counts.rows += 1
        if not isinstance(record, dict):
            counts.skipped["malformed_json"] += 1
        else:
            counts.layouts[detect_layout(record, fmt) or "unknown"] += 1
            messages, reason, row_info = normalize_record(record, fmt)
            counts.info.update(row_info)
            if reason:
                counts.skipped[reason] += 1
            else:
                row_id = record.get("id", record.get("question_id", record.get("prompt_id")))
                messages = [{**m, "truncated": bool(m.get("truncated"))} for m in messages]
                yield {"id": str(row_id) if row_id is not None else f"row{index}", "messages": messages}
        if limit is not None and counts.rows + read.malformed_json + read.non_object >= limit:
            break
    bar.close()


def _conversations_dataset(rows, work: str, input: str, counts: _RowCounts):
    """``Dataset.from_generator(rows)`` (columns ``id``, ``messages``) cached in ``work``; a :class:`VatError` when no
    row is usable."""
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "messages": [
                {
                    "role": datasets.Value("string"),
                    "content": datasets.Value("string"),
                    "truncated": datasets.Value("bool"),
                }
            ],
        }
    )
    try:
        return datasets.Dataset.from_generator(rows, features=features, cache_dir=work, fingerprint=uuid.uuid4().hex)
    except ValueError as err:  # datasets refuses a generator that yields nothing
        if "corresponds to no data" not in str(err):
            raise
        raise VatError(
            f"no usable conversation in {input} (read {counts.rows} rows, skipped {dict(counts.skipped)})"
        ) from None


def _tokenize_dataset(raw, tokenizer, method: str, max_length: int, num_proc: int):
    """``raw``'s conversations as ``id``, ``input_ids``, ``loss_mask``, ``length`` and ``skip`` (reason or "")."""
    if len(raw) == 0:
        return raw.remove_columns(["messages"]).add_column("skip", [])
    return raw.map(
        _tokenize_batch,
        batched=True,
        batch_size=64,
        num_proc=min(num_proc, len(raw)) if num_proc > 1 else None,
        remove_columns=["messages"],
        fn_kwargs={"tokenizer": tokenizer, "method": method, "max_length": max_length},
        features=datasets.Features(
            {
                "id": datasets.Value("string"),
                "input_ids": datasets.Sequence(datasets.Value("int32")),
                "loss_mask": datasets.Sequence(datasets.Value("int8")),
                "length": datasets.Value("int32"),
                "skip": datasets.Value("string"),
            }
        ),
        new_fingerprint=uuid.uuid4().hex,
        load_from_cache_file=False,
        desc="tokenize",
    )


def _save_replacing(ds, output: str) -> None:
    """``ds.save_to_disk(output)``, written beside it first so an earlier dataset there is replaced only when done."""
    staging = output.rstrip("/") + f".tmp-{uuid.uuid4().hex[:8]}"
    ds.save_to_disk(staging)
    if os.path.isdir(output):
        shutil.rmtree(output)
    os.replace(staging, output)


def _chat_stats(
    input: str,
    source: str,
    tok_path: str | None,
    method: str,
    max_length: int,
    num_proc: int,
    read: ReadStats,
    counts: _RowCounts,
    rows_kept: int,
    tokens: int,
    loss_tokens: int,
    t0: float,
) -> dict:
    """The stats of :func:`prepare_chat` (the reader's malformed values added to the skipped rows, so that
    ``rows_read == rows_kept + sum(skipped)``; a mismatch is logged as an error)."""
    skipped = counts.skipped
    # Malformed values seen by the file reader never reached normalisation.
    skipped["malformed_json"] += read.malformed_json + read.non_object
    rows_read = counts.rows + read.malformed_json + read.non_object
    if rows_read != rows_kept + sum(skipped.values()):  # an accounting bug, not bad input: say so loudly
        logger.error(
            "row accounting mismatch: read %d != kept %d + skipped %d", rows_read, rows_kept, sum(skipped.values())
        )
    return {
        "input": input,
        "source": source,
        "tokenizer": tok_path,
        "mask_method": method,
        "max_length": max_length,
        "num_proc": num_proc,
        "rows_read": rows_read,
        "rows_kept": rows_kept,
        "skipped": dict(skipped),
        "truncated_tail": {
            "truncated": read.truncated_tail,
            "at_char": read.truncated_at_char,
            "tail_chars": read.truncated_tail_chars,
        },
        "layouts": dict(counts.layouts),
        "dropped_leading_turns": counts.info["dropped_leading_turns"],
        "dropped_trailing_turns": counts.info["dropped_trailing_turns"],
        "tokens_kept": tokens,
        "loss_tokens_kept": loss_tokens,
        "seconds": round(time.time() - t0, 2),
    }


def _count_loss_tokens(ds) -> int:
    import pyarrow.compute as pc

    total = 0
    for batch in ds.select_columns(["loss_mask"]).with_format("arrow").iter(batch_size=10000):
        total += int(pc.sum(pc.list_flatten(batch["loss_mask"])).as_py() or 0)
    return total


def format_stats(stats: dict) -> str:
    """A short human-readable summary of a stats dict (printed by the CLI)."""
    skipped = ", ".join(f"{k}={v}" for k, v in stats["skipped"].items() if v) or "none"
    tail = stats["truncated_tail"]
    lines = [
        f"rows read {stats['rows_read']}, kept {stats['rows_kept']}, skipped: {skipped}",
        f"tokens kept {stats['tokens_kept']} (loss tokens {stats['loss_tokens_kept']}), mask method {stats['mask_method']}, "
        f"{stats['seconds']} s",
    ]
    if tail["truncated"]:
        lines.append(f"input truncated at char {tail['at_char']} ({tail['tail_chars']} chars dropped)")
    return "\n".join(lines)


def main(args) -> int:
    """Entry point of ``vat prep chat``."""
    if args.max_length <= 0:
        raise VatError("--max-length must be positive")
    stats = prepare_chat(
        args.input,
        args.tokenizer,
        args.output,
        fmt=args.format,
        max_length=args.max_length,
        num_proc=args.num_proc,
        limit=args.limit,
    )
    print(format_stats(stats))
    print(f"wrote {args.output} (stats: {os.path.join(args.output, 'stats.json')})")
    return 0
