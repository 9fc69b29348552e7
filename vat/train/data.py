"""Training data: prepared datasets, length-bucketed batches with a resumable position, and padding.

A prepared dataset (``vat prep chat``) has columns ``input_ids`` and ``loss_mask`` (1 = an assistant token the
draft learns to predict). Batches are built per epoch from a seeded permutation: samples of similar length are
grouped (so little compute goes to padding) under a token budget, then the batch order is shuffled. The position
in the data is ``(epoch, batch index)``, which is all a checkpoint needs to resume at the same batch.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch
from datasets import load_from_disk

from vat.errors import VatError


def load_prepared(path: str, max_length: int | None = None, limit: int | None = None):
    """Load a ``vat prep chat`` dataset (``datasets.load_from_disk``), dropping over-length samples.

    Returns:
        ``(dataset, n_dropped_over_length)``.
    """
    ds, dropped, _ = load_prepared_rows(path, max_length, limit)
    return ds, dropped


def load_prepared_rows(path: str, max_length: int | None = None, limit: int | None = None):
    """:func:`load_prepared` and, for each kept sample, its row in the saved dataset (what a capture is keyed by).

    Returns:
        ``(dataset, n_dropped_over_length, rows)``.
    """
    if not os.path.exists(path):
        raise VatError(f"prepared dataset not found: {path} (make one with `vat prep chat`)")
    try:
        ds = load_from_disk(path)
    except Exception as err:
        raise VatError(f"cannot read prepared dataset {path}: {str(err).splitlines()[0]}") from None
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise VatError(f"dataset {path} lacks column(s) {sorted(missing)}: prepare it with `vat prep chat`")
    rows = list(range(len(ds)))
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
        rows = rows[:len(ds)]
    dropped = 0
    if max_length is not None:
        lengths = ds["length"] if "length" in ds.column_names else [len(x) for x in ds["input_ids"]]
        keep = [i for i, n in enumerate(lengths) if n <= max_length]
        dropped = len(ds) - len(keep)
        if dropped:
            ds = ds.select(keep)
            rows = [rows[i] for i in keep]
    if len(ds) == 0:
        raise VatError(f"dataset {path} has no sample of at most {max_length} tokens")
    return ds, dropped, rows


@dataclass
class BucketedBatches:
    """Deterministic length-bucketed batches of sample indices.

    Args:
        lengths: token length of every sample.
        tokens_per_batch: cap on (longest sample in the batch) x (batch size).
        max_batch_size: cap on samples per batch.
        seed: base seed; epoch e uses seed + e.
        shuffle: shuffle samples and batch order (else sequential, still bucketed).
        num_replicas / rank: every rank takes batches ``rank::num_replicas`` of an equal-length prefix.
    """

    lengths: list[int]
    tokens_per_batch: int
    max_batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_replicas: int = 1
    rank: int = 0

    def epoch(self, epoch: int) -> list[list[int]]:
        """The batches this rank runs in ``epoch``, in order."""
        rng = random.Random(self.seed + epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        chunk = max(self.max_batch_size * 64, 1)  # sort within large chunks: bucketed, yet still random
        batches: list[list[int]] = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start:start + chunk], key=lambda i: self.lengths[i])
            current: list[int] = []
            longest = 0
            for i in part:
                longest_if = max(longest, self.lengths[i])
                if current and (longest_if * (len(current) + 1) > self.tokens_per_batch
                                or len(current) >= self.max_batch_size):
                    batches.append(current)
                    current, longest_if = [], self.lengths[i]
                current.append(i)
                longest = longest_if
            if current:
                batches.append(current)
        if self.shuffle:
            rng.shuffle(batches)
        per_rank = len(batches) // self.num_replicas
        if per_rank == 0:
            raise VatError(f"{len(batches)} batch(es) cannot be shared by {self.num_replicas} processes")
        return batches[self.rank:per_rank * self.num_replicas:self.num_replicas]

    def __len__(self) -> int:
        return len(self.epoch(0))


def collate(samples: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples to one batch.

    Returns:
        ``input_ids (B, T)``, ``attention_mask (B, T)`` and ``loss_mask (B, T)`` (0 on padding).
    """
    longest = max(len(s["input_ids"]) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, longest), pad_id, dtype=torch.long)
    attention = torch.zeros(batch, longest, dtype=torch.long)
    loss_mask = torch.zeros(batch, longest, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[row, :n] = torch.as_tensor(s["input_ids"], dtype=torch.long)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.as_tensor(s["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
