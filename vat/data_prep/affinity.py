"""`vat prep affinity`: the token -> expert affinity table of docs/vat_losses.md, precomputed over a prepared dataset.

``A[v, l, e] = P(expert e in the top-k at MoE layer l | the target reads token v)``, from the executed routing the
frozen target captures (:mod:`vat.target`), smoothed toward the per-layer marginal so rare tokens read as the
marginal::

    A[v, l, e] = (count[v, l, e] + alpha * marginal[l, e]) / (n_v + alpha)

Each row sums to ``top_k`` per layer (for seen and unseen tokens alike) as long as every token selects ``top_k``
experts. Rows are target ids, or draft ids when a draft vocab is given (then tokens outside it count toward the
marginal only). The file (safetensors) holds ``affinity`` float32 (V_rows, L', E), ``token_counts`` int64 (V_rows,),
``marginal`` float32 (L', E) and ``layers`` int64 (L',), with ``top_k``, ``num_experts``, ``indexed_by`` (``target_id``
or ``draft_id``), ``alpha`` and the token total in its metadata. :class:`vat.affinity.OnlineAffinity` loads it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from vat.affinity import smoothed_affinity
from vat.data_prep.vocab import load_draft_vocab, load_prepared_dataset, target_to_draft_ids
from vat.errors import VatError
from vat.target import load_target

DEFAULT_ALPHA = 4.0  # pseudo-occurrences of the marginal in every row (the trainer's online default too)
INT32_MAX = 2**31 - 1  # a cell's count is at most the tokens counted: int32 is exact below this many
ROW_CHUNK = 4096  # rows per chunk when smoothing


@dataclass
class RoutingCounts:
    """Sufficient statistics of the affinity table; add two of them to merge batches.

    Attributes:
        counts: (V_rows, L', E) int32 (int64 past 2^31 counted tokens) selections of expert e at layer l when the target read the row's token.
        token_counts: (V_rows,) occurrences of each row's token.
        marginal_counts: (L', E) selections over every counted token (inside the rows or not).
        total: number of counted tokens (the marginal's denominator).
    """

    counts: torch.Tensor
    token_counts: torch.Tensor
    marginal_counts: torch.Tensor
    total: int

    def __add__(self, other: RoutingCounts) -> RoutingCounts:
        counts = self.counts + other.counts if self.total + other.total <= INT32_MAX else (
            self.counts.long() + other.counts.long())
        return RoutingCounts(
            counts,
            self.token_counts + other.token_counts,
            self.marginal_counts + other.marginal_counts,
            self.total + other.total,
        )

    def marginal(self, top_k: int) -> torch.Tensor:
        """(L', E) P(expert e selected at layer l) over all counted tokens; uniform ``top_k / E`` with no data."""
        if self.total <= 0:
            return torch.full(self.marginal_counts.shape, top_k / self.marginal_counts.shape[-1], dtype=torch.float64)
        return self.marginal_counts.to(torch.float64) / self.total

    def affinity(self, top_k: int, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
        """(V_rows, L', E) smoothed affinity table."""
        if alpha <= 0 and bool((self.token_counts == 0).any()):
            raise VatError("alpha must be > 0 when some rows were never seen (their affinity would be 0/0)")

        marg = self.marginal(top_k).to(self.counts.device)  # (L', E) fp64
        table = torch.empty(self.counts.shape, dtype=torch.float32, device=self.counts.device)
        for lo in range(0, table.shape[0], ROW_CHUNK):  # fp64 per row chunk: no full-size fp64 intermediate
            rows = slice(lo, lo + ROW_CHUNK)
            table[rows] = smoothed_affinity(self.counts[rows].to(torch.float64),
                                            self.token_counts[rows].to(torch.float64), marg, alpha).to(torch.float32)
        return table


def _row_map(vocab_rows, device) -> tuple[torch.Tensor | None, int]:
    if isinstance(vocab_rows, int):
        return None, vocab_rows
    rows = vocab_rows.to(device=device, dtype=torch.int64)
    return rows, int((rows >= 0).sum())


def empty_counts(num_rows: int, num_layers: int, num_experts: int, device=None) -> RoutingCounts:
    """Zero :class:`RoutingCounts` to accumulate into: the (V_rows, L', E) counts in int32 (half of int64: a 152k
    target vocab x 48 layers x 128 experts is 3.7 GB instead of 7.5; widened to int64 before the counted tokens
    could overflow it, so exact at any data size), the small ones in int64."""
    z = dict(dtype=torch.int64, device=device)
    return RoutingCounts(
        torch.zeros(num_rows, num_layers, num_experts, dtype=torch.int32, device=device),
        torch.zeros(num_rows, **z),
        torch.zeros(num_layers, num_experts, **z),
        0,
    )


def routing_counts(
    input_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    valid_mask: torch.Tensor | None,
    vocab_rows: torch.Tensor | int,
    num_experts: int,
    into: RoutingCounts | None = None,
) -> RoutingCounts:
    """Count expert selections per input token for one batch of captured routing.

    Args:
        input_ids: (B, T) target token ids the target read.
        topk_ids: (L', B, T, k) executed expert ids; ids outside ``[0, num_experts)`` are dropped slots.
        valid_mask: (B, T) bool real tokens (None = all).
        vocab_rows: (V,) int64 row of each target id (−1 = no row, e.g. ``target_to_draft_ids(t2d)``), or an int V
            for rows indexed by target id.
        num_experts: E.
        into: counts to add to in place (same device as ``topk_ids``); None = fresh ones.

    Returns:
        The (updated) :class:`RoutingCounts`.
    """
    num_layers, batch, length, k = topk_ids.shape
    device = topk_ids.device
    rows_of, n_rows = _row_map(vocab_rows, device)
    out = into if into is not None else empty_counts(n_rows, num_layers, num_experts, device)
    if tuple(out.counts.shape) != (n_rows, num_layers, num_experts):
        raise VatError(
            f"counts of shape {tuple(out.counts.shape)} cannot take routing of {(n_rows, num_layers, num_experts)}"
        )
    valid = torch.ones(batch, length, dtype=torch.bool, device=device) if valid_mask is None else valid_mask.bool()
    ids = input_ids.to(device)[valid].long()  # (n,) the tokens read
    experts = topk_ids.permute(1, 2, 0, 3)[valid].long()  # (n, L', k)
    vocab_size = n_rows if rows_of is None else rows_of.numel()
    if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise VatError(f"token id {int(ids.max())} is outside the target vocabulary of size {vocab_size}")
    rows = ids if rows_of is None else rows_of[ids]  # (n,) row per token, -1 = none
    if out.counts.dtype != torch.int64 and out.total + ids.numel() > INT32_MAX:
        out.counts = out.counts.long()  # a cell could pass int32 now
    sel = (experts >= 0) & (experts < num_experts)  # (n, L', k) executed slots
    layer = torch.arange(num_layers, device=device).view(1, -1, 1).expand_as(experts)  # (n, L', k)
    cell = layer * num_experts + experts  # (n, L', k) layer-expert cell
    _bump(out.marginal_counts, cell[sel])
    in_rows = sel & (rows >= 0).view(-1, 1, 1)  # (n, L', k)
    _bump(out.counts, (rows.view(-1, 1, 1) * (num_layers * num_experts) + cell)[in_rows])
    _bump(out.token_counts, rows[rows >= 0])
    out.total += int(ids.numel())
    return out


def _bump(counts: torch.Tensor, flat_index: torch.Tensor) -> None:
    """``counts.view(-1)[i] += 1`` for every i in ``flat_index`` (repeats accumulate)."""
    flat = counts.view(-1)
    flat.index_put_((flat_index,), torch.ones_like(flat_index, dtype=flat.dtype), accumulate=True)


def affinity_from_routing(
    input_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    valid_mask: torch.Tensor | None,
    vocab_rows: torch.Tensor | int,
    num_experts: int,
    alpha: float = DEFAULT_ALPHA,
    top_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smoothed affinity table of one batch of routing (pure function; usable online).

    Args:
        input_ids: (B, T) target token ids.
        topk_ids: (L', B, T, k) executed expert ids (out-of-range = dropped slot).
        valid_mask: (B, T) bool real tokens, or None.
        vocab_rows: (V,) int64 row per target id (−1 = none) or an int V (rows = target ids).
        num_experts: E.
        alpha: smoothing strength (pseudo-occurrences of the per-layer marginal in each row).
        top_k: k for the no-data marginal (default: ``topk_ids.shape[-1]``).

    Returns:
        ``(affinity, token_counts)``: (V_rows, L', E) float32 and (V_rows,) int64.
    """
    stats = routing_counts(input_ids, topk_ids, valid_mask, vocab_rows, num_experts)
    return stats.affinity(top_k or topk_ids.shape[-1], alpha), stats.token_counts


def save_affinity(path: str, stats: RoutingCounts, layers: list[int], top_k: int, alpha: float, metadata: dict) -> None:
    """Write the table (see the module docstring for keys and metadata)."""
    num_experts = stats.counts.shape[-1]
    tensors = {
        "affinity": stats.affinity(top_k, alpha).float().contiguous(),
        "token_counts": stats.token_counts.to(torch.int64).contiguous(),
        "marginal": stats.marginal(top_k).float().contiguous(),
        "layers": torch.tensor(layers, dtype=torch.int64),
    }
    meta = {"top_k": str(top_k), "num_experts": str(num_experts), "alpha": str(alpha), "tokens": str(stats.total)}
    meta.update({k: str(v) for k, v in metadata.items()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path + ".tmp", metadata=meta)
    os.replace(path + ".tmp", path)


def collect_routing(
    target,
    dataset,
    vocab_rows: torch.Tensor | int,
    layer_positions: list[int],
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
) -> RoutingCounts:
    """Run the frozen target over a prepared dataset and accumulate :class:`RoutingCounts`.

    Args:
        target: a :class:`vat.target.FrozenTarget`.
        dataset: rows with ``input_ids`` (``vat prep chat`` output).
        vocab_rows: as in :func:`routing_counts`.
        layer_positions: indices into the target's MoE layers (``target.moe_layer_ids``) to keep.
        batch_size: rows per forward (right-padded; sorted by length to waste little padding).
        max_length: truncate rows to this many tokens.
        progress: tqdm bar.
    """
    lengths = dataset["length"] if "length" in dataset.column_names else [len(x) for x in dataset["input_ids"]]
    order = sorted(range(len(dataset)), key=lambda i: -lengths[i])
    device = target.device
    total: RoutingCounts | None = None
    bar = tqdm(total=len(order), desc="affinity", unit=" rows", disable=not progress)
    for start in range(0, len(order), batch_size):
        rows = dataset.select(order[start : start + batch_size])["input_ids"]
        rows = [r[:max_length] if max_length else r for r in rows]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)  # (B, T) right-padded
        mask = torch.zeros(len(rows), width, dtype=torch.int64)  # (B, T)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
            mask[b, : len(r)] = 1
        out = target.forward(ids.to(device), attention_mask=mask.to(device), output_aux=False, logits_to_keep=1)
        topk = out.topk_ids[layer_positions]  # (L', B, T, k)
        total = routing_counts(ids.to(device), topk, mask.to(device).bool(), vocab_rows, target.num_experts, into=total)
        bar.update(len(rows))
    bar.close()
    if total is None:
        raise VatError("the dataset is empty: nothing to build an affinity table from")
    return RoutingCounts(total.counts.cpu(), total.token_counts.cpu(), total.marginal_counts.cpu(), total.total)


def _layer_positions(moe_layer_ids: list[int], requested: list[int] | None) -> list[int]:
    if not requested:
        return list(range(len(moe_layer_ids)))
    missing = [layer for layer in requested if layer not in moe_layer_ids]
    if missing:
        raise VatError(f"--layers {missing} are not MoE layers of this target (its MoE layers: {moe_layer_ids})")
    return [moe_layer_ids.index(layer) for layer in requested]


def main(args) -> int:
    """Entry point of ``vat prep affinity``."""
    t0 = time.time()
    ds = load_prepared_dataset(args.data)
    if args.limit is not None:
        ds = ds.select(range(min(args.limit, len(ds))))
    target = load_target(args.target, dtype="auto")
    positions = _layer_positions(target.moe_layer_ids, args.layers)
    if args.vocab:
        _, t2d = load_draft_vocab(args.vocab)
        if t2d.numel() != target.vocab_size:
            raise VatError(
                f"draft vocab {args.vocab} is for a target vocab of {t2d.numel()}, this target has {target.vocab_size}"
            )
        vocab_rows, indexed_by = target_to_draft_ids(t2d).to(target.device), "draft_id"
    else:
        vocab_rows, indexed_by = target.vocab_size, "target_id"
    stats = collect_routing(target, ds, vocab_rows, positions, batch_size=args.batch_size)
    layers = [target.moe_layer_ids[p] for p in positions]
    alpha = getattr(args, "alpha", DEFAULT_ALPHA)
    save_affinity(
        args.output,
        stats,
        layers,
        target.top_k,
        alpha,
        {
            "indexed_by": indexed_by,
            "target": args.target,
            "data": os.path.abspath(args.data),
            "vocab": args.vocab or "",
        },
    )
    seen = int((stats.token_counts > 0).sum())
    print(
        f"affinity {tuple(stats.counts.shape)} ({indexed_by} rows x MoE layers {layers} x {target.num_experts} experts, "
        f"top_k {target.top_k}); {stats.total} tokens, {seen} rows seen; {time.time() - t0:.1f} s -> {args.output}"
    )
    return 0
