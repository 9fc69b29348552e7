"""`vat prep capture`: run the frozen target once over a prepared dataset and store, per sample, what training reads
from it (the aux hidden states, the last hidden state, the executed top-k routing of every MoE layer), so that
``data.capture`` trains without the target's weights (layout: :mod:`vat.data_prep.capture_store`, docs/data.md).

The forward is the trainer's own (:meth:`vat.target.FrozenTarget.forward`, natural routing, no budget). Rows are
captured in dataset order, a shard of about ``shard_tokens`` tokens at a time (length-bucketed batches inside a
shard); the manifest is rewritten after each shard, so a rerun of the same command continues after the last complete
one and a rerun with other settings into the same directory stops in one line.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from vat.data_prep.capture_store import (
    FORMAT,
    plan_shards,
    read_manifest,
    routing_dtype,
    shard_name,
    write_manifest,
)
from vat.data_prep.vocab import load_prepared_dataset
from vat.errors import VatError
from vat.target import FrozenTarget, load_target
from vat.target.captured import weights_fingerprint

# tokens per shard: a shard is held in host memory until it is written, (n_aux + 1) * H * bytes per token (2 GiB for
# a Qwen3-30B-A3B shape in bf16) -- and it is the unit a rerun resumes at
SHARD_TOKENS = 1 << 17
LOGIT_TOLERANCE = 1e-3  # relative: the recomputed logits must be the target's own (they are, bit for bit, usually)


def target_identity(target: FrozenTarget, name: str) -> dict[str, Any]:
    """The facts of ``target`` a capture records and a training run checks its own target against."""
    return {
        "path": target.path or name, "model_type": str(target.config.model_type), "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size, "num_layers": target.num_layers, "num_experts": target.num_experts,
        "top_k": target.top_k, "moe_layer_ids": list(target.moe_layer_ids), "aux_layer_ids": list(target.aux_layer_ids),
        "weights": weights_fingerprint(target.embed_tokens(), target.final_norm(), target.lm_head())
        if target.final_norm() is not None else None,
    }


def select_rows(lengths: list[int], limit: int | None, max_length: int | None) -> list[int]:
    """The dataset rows captured: the first ``limit`` (all when None) of at most ``max_length`` tokens."""
    rows = range(len(lengths) if limit is None else min(limit, len(lengths)))
    return [r for r in rows if max_length is None or lengths[r] <= max_length]


def _start(output: str, fresh: dict[str, Any]) -> dict[str, Any]:
    """A new manifest, or the one in ``output`` when it records the same capture (then its shards are kept)."""
    if not os.path.exists(os.path.join(output, "manifest.json")):
        os.makedirs(output, exist_ok=True)
        write_manifest(output, fresh)  # before any shard: every shard file in the directory is of these settings
        return fresh
    old = read_manifest(output)
    for key in ("target", "data", "rows", "dtype", "shard_tokens"):
        if old.get(key) != fresh[key]:
            shown = key if key == "rows" else f"{key} {old.get(key)} -> {fresh[key]}"
            raise VatError(f"{output} holds a capture with other settings ({shown}): write to another --output or "
                           "delete it")
    return old


def _record(output: str, manifest: dict[str, Any], plan: list[tuple[int, int]], lengths: list[int],
            written: dict[str, float]) -> dict[str, Any]:
    """The manifest rebuilt from the shard files present and written (a shard file appears, by rename, only once
    complete, so parts running at once each add theirs); ``written``: seconds of the shards this process wrote."""
    previous = {s["file"]: s for s in read_manifest(output)["shards"]}
    shards = []
    for index, (start, end) in enumerate(plan):
        name = shard_name(index)
        if os.path.exists(os.path.join(output, name)):
            seconds = written.get(name, previous.get(name, {}).get("seconds", 0.0))
            shards.append({"file": name, "start": start, "end": end, "tokens": sum(lengths[start:end]),
                           "bytes": os.path.getsize(os.path.join(output, name)), "seconds": seconds})
    totals = {key: sum(s[key] for s in shards) for key in ("tokens", "bytes", "seconds")}
    manifest = dict(manifest, shards=shards, complete=len(shards) == len(plan), **totals)
    write_manifest(output, manifest)
    return manifest


def _batches(rows: list[int], lengths: list[int], tokens_per_batch: int, max_batch_size: int) -> list[list[int]]:
    """Rows sorted by length, cut into batches of at most ``tokens_per_batch`` padded tokens."""
    batches, current = [], []
    for row in sorted(rows, key=lambda r: lengths[r]):
        if current and (lengths[row] * (len(current) + 1) > tokens_per_batch or len(current) >= max_batch_size):
            batches.append(current)
            current = []
        current.append(row)
    return batches + [current] if current else batches


def _check_logits(target: FrozenTarget, out: Any, attention: torch.Tensor) -> None:
    """Refuse a target whose logits are not ``lm_head(final_norm(last hidden))``: training would see other ones."""
    norm = target.final_norm()
    if norm is None or out.last_hidden is None:
        raise VatError(f"{type(target.model).__name__}: vat finds no final norm before the LM head, so a capture "
                       "cannot give the trainer the logits; train online")
    with torch.no_grad():
        recomputed = target.lm_head()(norm(out.last_hidden))  # (B, T, V)
    keep = attention.bool()
    error = (recomputed[keep].float() - out.logits[keep].float()).abs().max()
    scale = out.logits[keep].float().abs().max().clamp_min(1.0)
    if float(error / scale) > LOGIT_TOLERANCE:
        raise VatError(f"{type(target.model).__name__}: LM head(final norm(last hidden)) differs from the target's "
                       f"logits by {float(error):.3g} (logit scaling or soft-capping?): train online")


def _capture_shard(target: FrozenTarget, ds, rows: list[int], lengths: list[int], settings: dict[str, Any],
                   bar) -> dict[str, torch.Tensor]:
    """One shard's tensors (``aux.r``, ``last.r``, ``routing.r``, ``input_ids.r`` per row r)."""
    pad_id = getattr(target.config, "pad_token_id", None) or 0
    ids_dtype = routing_dtype(target.num_experts)
    tensors: dict[str, torch.Tensor] = {}
    for batch_rows in _batches(rows, lengths, settings["tokens_per_batch"], settings["max_batch_size"]):
        longest = max(lengths[r] for r in batch_rows)
        input_ids = torch.full((len(batch_rows), longest), pad_id, dtype=torch.long)  # (B, T)
        attention = torch.zeros_like(input_ids)  # (B, T)
        for b, row in enumerate(batch_rows):
            input_ids[b, :lengths[row]] = torch.as_tensor(ds[row]["input_ids"], dtype=torch.long)
            attention[b, :lengths[row]] = 1
        input_ids, attention = input_ids.to(target.device), attention.to(target.device)
        out = target.forward(input_ids, attention_mask=attention)
        if not settings.get("logits_checked"):
            _check_logits(target, out, attention)
            settings["logits_checked"] = True
        for b, row in enumerate(batch_rows):
            n = lengths[row]
            tensors[f"aux.{row}"] = out.aux_hidden[b, :n].cpu().clone()  # (T, n_aux*H)
            tensors[f"last.{row}"] = out.last_hidden[b, :n].cpu().clone()  # (T, H)
            tensors[f"routing.{row}"] = out.topk_ids[:, b, :n].transpose(0, 1).to(ids_dtype).cpu().contiguous()  # (T, L', k)
            tensors[f"input_ids.{row}"] = input_ids[b, :n].to(torch.int32).cpu().clone()  # (T,)
        bar.update(int(attention.sum()))
    return tensors


def capture(target: str, data: str, output: str, *, aux_layer_ids: list[int] | None = None, dtype: str = "auto",
            device: str | None = None, device_map: str | None = None, experts_impl: str = "grouped_mm",
            tokens_per_batch: int = 8192, max_batch_size: int = 16, shard_tokens: int = SHARD_TOKENS,
            limit: int | None = None, max_length: int | None = None, part: tuple[int, int] = (0, 1),
            progress: bool = True) -> dict[str, Any]:
    """Capture ``target``'s features over the prepared dataset ``data`` into ``output`` (resumable).

    Args:
        target: the target (path, hub name or ``tiny-quick`` etc.), loaded by :func:`vat.target.load_target`.
        data: a ``vat prep chat`` dataset directory.
        output: the capture directory.
        aux_layer_ids: layer outputs to capture (vat's convention; default EAGLE-3's); the draft must read these.
        dtype, device, device_map, experts_impl: passed to :func:`vat.target.load_target`.
        tokens_per_batch, max_batch_size: forward batches (padded tokens, rows).
        shard_tokens: tokens per shard file (held in host memory until written; the unit a rerun resumes at).
        limit, max_length: capture the first ``limit`` rows, skipping rows over ``max_length`` tokens.
        part: ``(i, n)``: write only the shards whose index is i mod n (n processes, e.g. one per node, fill one
            capture; the manifest is complete once every shard is written, whoever wrote it).
        progress: show a progress bar (tokens, tokens/s).

    Returns:
        The final manifest.
    """
    ds = load_prepared_dataset(data)
    if "input_ids" not in ds.column_names:
        raise VatError(f"dataset {data} has no input_ids column: prepare it with `vat prep chat`")
    lengths = list(ds["length"]) if "length" in ds.column_names else [len(x) for x in ds["input_ids"]]
    rows = select_rows(lengths, limit, max_length)
    if not rows:
        raise VatError(f"dataset {data} has no row of at most {max_length} tokens to capture")
    frozen = load_target(target, dtype=dtype, device=device, experts_impl=experts_impl, aux_layer_ids=aux_layer_ids,
                         device_map=device_map)
    settings = {"tokens_per_batch": tokens_per_batch, "max_batch_size": max_batch_size}
    row_lengths = [lengths[r] for r in rows]
    manifest = _start(output, {
        "format": FORMAT, "complete": False, "target": target_identity(frozen, target),
        "dtype": str(frozen.dtype).removeprefix("torch."), "routing": True,
        "routing_dtype": str(routing_dtype(frozen.num_experts)).removeprefix("torch."),
        "data": {"path": os.path.abspath(data), "rows_total": len(lengths), "limit": limit, "max_length": max_length},
        "rows": rows, "lengths": row_lengths, "shard_tokens": shard_tokens, "shards": [], "tokens": 0, "bytes": 0,
        "seconds": 0.0,
    })
    plan = plan_shards(row_lengths, shard_tokens)
    mine = [i for i in range(len(plan)) if i % part[1] == part[0]]
    todo = [i for i in mine if not os.path.exists(os.path.join(output, shard_name(i)))]  # a rerun skips complete ones
    tokens = {i: sum(row_lengths[start:end]) for i, (start, end) in enumerate(plan)}
    bar = tqdm(total=sum(tokens[i] for i in mine), initial=sum(tokens[i] for i in mine if i not in todo), unit="tok",
               unit_scale=True, desc="capture", disable=not progress, dynamic_ncols=True)
    written: dict[str, float] = {}
    try:
        for index in todo:
            start, end = plan[index]
            began = time.time()
            tensors = _capture_shard(frozen, ds, rows[start:end], lengths, settings, bar)
            path = os.path.join(output, shard_name(index))
            save_file(tensors, f"{path}.{os.getpid()}.tmp", metadata={"format": FORMAT})
            os.replace(f"{path}.{os.getpid()}.tmp", path)
            written[shard_name(index)] = round(time.time() - began, 3)
            manifest = _record(output, manifest, plan, row_lengths, written)
    finally:
        bar.close()
        frozen.close()
    return _record(output, manifest, plan, row_lengths, written)


def _part(text: str) -> tuple[int, int]:
    """``--part I/N`` -> (I, N), 0 <= I < N; anything else in one line."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise VatError(f"--part must be I/N (e.g. 0/4), got `{text}`") from None
    if not 0 <= index < count:
        raise VatError(f"--part {text}: I must be in [0, N)")
    return index, count


def main(args) -> int:
    """Entry point of ``vat prep capture``."""
    manifest = capture(
        args.target, args.data, args.output, aux_layer_ids=args.aux_layer_ids, dtype=args.dtype, device=args.device,
        device_map=args.device_map, experts_impl=args.experts_impl, tokens_per_batch=args.tokens_per_batch,
        max_batch_size=args.max_batch_size, shard_tokens=args.shard_tokens, limit=args.limit,
        max_length=args.max_length, part=_part(args.part), progress=not args.no_progress,
    )
    tokens, seconds = manifest["tokens"], max(manifest["seconds"], 1e-9)
    if not manifest["complete"]:
        print(f"part {args.part} done; the capture is complete once every part has run")
    print(f"captured {len(manifest['rows'])} rows, {tokens:,} tokens in {len(manifest['shards'])} shard(s) to "
          f"{args.output}: {manifest['bytes'] / max(tokens, 1) * 1000 / 2**20:.2f} MiB and "
          f"{seconds / max(tokens, 1) * 1000:.3f} s per 1,000 tokens ({tokens / seconds:,.0f} tokens/s)")
    return 0
