"""`vat prep vocab`: the reduced draft vocabulary (d2t / t2d) from loss-masked token frequencies.

The draft's LM head predicts only the N most frequent target tokens at loss-masked positions (ties broken by the
lower target id), stored sorted ascending by target id, as EAGLE / SpecForge / speculators do. The file uses the
SGLang / vLLM convention:

* ``d2t`` int64 (N,): offsets, ``target_id = draft_id + d2t[draft_id]`` (SGLang's ``hot_token_id = d2t + arange``);
* ``t2d`` bool (V,): True where the target id is in the draft vocab.

A size at or above the target vocabulary gives the identity mapping (``d2t`` all zeros, ``t2d`` all True).
"""

from __future__ import annotations

import json
import os

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer

from vat.errors import VatError, require_file

FORMAT = "vat-draft-vocab"


def count_tokens(dataset, vocab_size: int, batch_size: int = 1000) -> torch.Tensor:
    """Count each target token at loss-masked positions (``loss_mask == 1``) of a prepared dataset.

    Args:
        dataset: a ``datasets.Dataset`` with ``input_ids`` and ``loss_mask`` columns (``vat prep chat`` output).
        vocab_size: V, the target vocabulary size.
        batch_size: rows per batch while streaming.

    Returns:
        (V,) int64 counts.

    Raises:
        VatError: a token id is outside ``[0, vocab_size)``.
    """
    import pyarrow.compute as pc

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    cols = dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow")
    for batch in cols.iter(batch_size=batch_size):  # pyarrow tables: flatten the list columns without Python loops
        ids = torch.from_numpy(pc.list_flatten(batch["input_ids"]).to_numpy(zero_copy_only=False).astype("int64"))
        mask = torch.from_numpy(pc.list_flatten(batch["loss_mask"]).to_numpy(zero_copy_only=False).astype(bool))
        sel = ids[mask]  # (N_loss,) tokens at loss-masked positions
        if sel.numel() and (int(sel.max()) >= vocab_size or int(sel.min()) < 0):
            raise VatError(f"token id {int(sel.max())} is outside the target vocabulary of size {vocab_size}")
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def build_draft_vocab(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary: the ``size`` most frequent target ids (ties -> lower id), sorted ascending.

    Ids never seen fill the remaining places lowest id first, so the draft vocab always has ``min(size, V)`` entries.

    Args:
        token_counts: (V,) counts per target id.
        size: draft vocabulary size N.

    Returns:
        ``(d2t, t2d)``: (N,) int64 offsets ``used[i] - i`` and (V,) bool membership. With ``size >= V``: the
        identity (``d2t`` all zeros of length V, ``t2d`` all True).
    """
    if size <= 0:
        raise VatError(f"draft vocab size must be positive, got {size}")
    vocab_size = int(token_counts.numel())
    if size >= vocab_size:
        return torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool)
    order = torch.argsort(-token_counts.to(torch.int64), stable=True)  # (V,) by count desc, ties by id asc
    used = torch.sort(order[:size]).values  # (N,) ascending target ids
    d2t = used - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """(N,) target id of each draft id: ``arange(N) + d2t``."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)


def target_to_draft_ids(t2d: torch.Tensor) -> torch.Tensor:
    """(V,) draft id of each target id, −1 where the target id is not in the draft vocab."""
    t2d = t2d.to(torch.bool)
    draft = torch.cumsum(t2d.to(torch.int64), dim=0) - 1  # (V,) rank among members
    return torch.where(t2d, draft, torch.full_like(draft, -1))


def save_draft_vocab(path: str, d2t: torch.Tensor, t2d: torch.Tensor, metadata: dict | None = None) -> None:
    """Write ``d2t`` (int64) and ``t2d`` (bool) to a safetensors file with the vocabulary sizes in its metadata."""
    _check(d2t, t2d)
    meta = {"format": FORMAT, "target_vocab_size": str(t2d.numel()), "draft_vocab_size": str(d2t.numel())}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file({"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}, tmp, metadata=meta)
    os.replace(tmp, path)


def load_draft_vocab(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``(d2t, t2d)`` written by :func:`save_draft_vocab` (or any safetensors file holding both)."""
    require_file(path, "draft vocab file")
    try:
        with safe_open(path, framework="pt") as f:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except Exception as err:
        raise VatError(f"cannot read draft vocab {path}: {str(err).splitlines()[0]}") from None
    _check(d2t, t2d)
    return d2t.to(torch.int64), t2d.to(torch.bool)


def read_vocab_metadata(path: str) -> dict:
    """The metadata dict of a draft-vocab file (strings)."""
    with safe_open(require_file(path, "draft vocab file"), framework="pt") as f:
        return dict(f.metadata() or {})


def _check(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise VatError("d2t and t2d must be 1-D")
    used = draft_to_target_ids(d2t.cpu())
    members = torch.nonzero(t2d.cpu().bool()).flatten()
    if not torch.equal(used, members):
        raise VatError("d2t and t2d disagree: d2t + arange must list, ascending, exactly the ids where t2d is True")


def _target_vocab_size(data_dir: str, override: int | None) -> tuple[int, str]:
    """V from ``--vocab-size``, else the config.json next to the tokenizer recorded in stats.json, else its length."""
    if override:
        return int(override), "--vocab-size"
    stats_path = os.path.join(data_dir, "stats.json")
    tok = None
    if os.path.exists(stats_path):
        with open(stats_path) as f:
            tok = json.load(f).get("tokenizer")
    if not tok:
        raise VatError(f"cannot tell the target vocabulary size: no tokenizer in {stats_path}; pass --vocab-size")
    if os.path.exists(os.path.join(tok, "config.json")):
        with open(os.path.join(tok, "config.json")) as f:
            cfg = json.load(f)
        size = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
        if size:
            return int(size), f"{tok}/config.json"

    return len(AutoTokenizer.from_pretrained(tok)), f"len(tokenizer {tok})"


def load_prepared_dataset(path: str):
    """The ``vat prep chat`` dataset saved at ``path`` (``datasets.load_from_disk``), as ``vat prep vocab`` and
    ``vat prep affinity`` read it.

    Raises:
        VatError: ``path`` is missing or is not a saved dataset, in one line.
    """
    require_file(path, "prepared dataset")
    try:
        return datasets.load_from_disk(path)
    except Exception as err:
        raise VatError(f"{path} is not a prepared dataset (vat prep chat output): {str(err).splitlines()[0]}") from None


def main(args) -> int:
    """Entry point of ``vat prep vocab``."""
    ds = load_prepared_dataset(args.data)
    vocab_size, source = _target_vocab_size(args.data, getattr(args, "vocab_size", None))
    counts = count_tokens(ds, vocab_size)
    d2t, t2d = build_draft_vocab(counts, args.size)
    total = int(counts.sum())
    covered = int(counts[t2d].sum())
    coverage = covered / total if total else 0.0
    save_draft_vocab(
        args.output,
        d2t,
        t2d,
        {"source_data": os.path.abspath(args.data), "loss_tokens": str(total), "coverage": f"{coverage:.6f}"},
    )
    distinct = int((counts > 0).sum())
    print(
        f"draft vocab {d2t.numel()} of {vocab_size} target ids (V from {source}); {distinct} distinct loss tokens; "
        f"covers {coverage:.2%} of {total} loss tokens -> {args.output}"
    )
    return 0
