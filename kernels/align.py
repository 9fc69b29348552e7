"""Group the (token, slot) pairs of a MoE forward by expert, padded per expert to the kernel's M-block size.

A forward routes T tokens to k experts each: ``topk_ids (T, k)``. Flattened, that is P = T·k *pairs*; pair ``p`` is
token ``p // k``, slot ``p % k``. The grouped GEMMs in :mod:`vat.kernels.fused_moe` run one program per (M-block,
N-block); every M-block holds pairs of a single expert, so the expert weights a launch reads are exactly the distinct
values of ``block_expert_ids``. Dropped slots carry the sentinel id ``num_experts`` (transformers' convention: its eager
experts forward skips ``expert_idx == num_experts``) and are left out here, which is how an expert budget turns into
fewer experts read.

Layout (vLLM ``moe_align_block_size`` style, but compact: only experts that are present get blocks, so the buffers and
the launch grid are bounded by ``ceil(P / BM) + n_present`` blocks and never grow with ``num_experts``):

- ``sorted_pair_ids (num_padded,)``: pair ids grouped by ascending expert id, ascending pair id inside an expert,
  each expert's run padded to a multiple of ``block_size`` with the pad value P.
- ``block_expert_ids (num_padded // block_size,)``: the expert of each M-block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vat.errors import VatError


@dataclass(frozen=True)
class Alignment:
    """Pairs grouped by expert and padded per expert to ``block_size``.

    Attributes:
        sorted_pair_ids: ``(num_padded,)`` int32 pair ids; padding slots hold ``num_pairs``.
        block_expert_ids: ``(num_padded // block_size,)`` int32 expert id of each M-block.
        num_pairs: P = T·k, also the pad value.
        block_size: the M-block size BM the ids are padded to.
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_pairs: int
    block_size: int

    @property
    def num_padded(self) -> int:
        """``num_tokens_post_padded``: the padded length of :attr:`sorted_pair_ids`."""
        return int(self.sorted_pair_ids.numel())

    @property
    def num_blocks(self) -> int:
        """Number of M-blocks (the M extent of the launch grid)."""
        return int(self.block_expert_ids.numel())

    def experts_read(self) -> list[int]:
        """Sorted ids of the experts whose weights a launch over this alignment reads (host sync)."""
        return sorted(set(self.block_expert_ids.tolist()))


def _check_ids(topk_ids: torch.Tensor) -> None:
    if topk_ids.dim() != 2:
        raise VatError(f"topk_ids must be (num_tokens, top_k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise VatError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> Alignment:
    """Group the pairs of ``topk_ids`` by expert, padded per expert to ``block_size`` (sentinel slots skipped).

    One host sync (the padded length sizes the buffers and the grid); everything else stays on the ids' device.

    Args:
        topk_ids: ``(T, k)`` integer expert ids in ``[0, num_experts]``; ``num_experts`` marks a dropped slot.
        num_experts: E, the number of experts of the layer.
        block_size: BM, the M-block size of the kernel that will consume the alignment.

    Returns:
        The :class:`Alignment`.

    Raises:
        VatError: ids outside ``[0, num_experts]`` or a bad shape / block size.
    """
    _check_ids(topk_ids)
    if block_size < 1:
        raise VatError(f"block_size must be positive, got {block_size}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # (P,)
    num_pairs = flat.numel()
    if num_pairs and int(flat.min()) < 0:
        raise VatError(f"expert ids must be >= 0, got {int(flat.min())}")
    # bincount sizes its output by the largest id, so an id > E shows up as extra bins without another sync.
    counts_all = torch.bincount(flat, minlength=num_experts + 1)  # (E + 1,) last bin = dropped slots
    if counts_all.numel() > num_experts + 1:
        raise VatError(
            f"expert id {counts_all.numel() - 1} out of range: ids must lie in [0, {num_experts}] "
            f"({num_experts} = dropped slot)"
        )
    counts = counts_all[:num_experts]  # (E,)
    blocks_per_expert = (counts + block_size - 1) // block_size  # (E,)
    num_blocks = int(blocks_per_expert.sum())  # the one host sync
    num_padded = num_blocks * block_size

    padded_start = torch.cumsum(blocks_per_expert, 0) * block_size - blocks_per_expert * block_size  # (E,)
    unpadded_start = torch.cumsum(counts, 0) - counts  # (E,)

    order = torch.argsort(flat, stable=True)  # (P,) pair ids, grouped by expert, sentinels last
    sorted_e = flat[order]  # (P,)
    valid = sorted_e < num_experts  # (P,)
    e_safe = sorted_e.clamp(max=num_experts - 1)  # (P,)
    rank = torch.arange(num_pairs, device=device) - unpadded_start[e_safe]  # (P,) position inside its expert
    dest = torch.where(valid, padded_start[e_safe] + rank, num_padded)  # (P,) dropped pairs -> dump slot

    sorted_pair_ids = torch.full((num_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_expert_ids = torch.repeat_interleave(
        torch.arange(num_experts, device=device, dtype=torch.int32), blocks_per_expert, output_size=num_blocks
    )  # (num_blocks,)
    return Alignment(sorted_pair_ids[:num_padded], block_expert_ids, num_pairs, block_size)


def align_block_size_reference(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> Alignment:
    """Slow, obvious version of :func:`align_block_size` (Python loops), used by the tests."""
    _check_ids(topk_ids)
    flat = topk_ids.reshape(-1).tolist()
    num_pairs = len(flat)
    sorted_ids: list[int] = []
    block_experts: list[int] = []
    for expert in range(num_experts):
        pairs = [p for p, e in enumerate(flat) if e == expert]
        if not pairs:
            continue
        n_blocks = -(-len(pairs) // block_size)
        sorted_ids += pairs + [num_pairs] * (n_blocks * block_size - len(pairs))
        block_experts += [expert] * n_blocks
    return Alignment(
        torch.tensor(sorted_ids, dtype=torch.int32),
        torch.tensor(block_experts, dtype=torch.int32),
        num_pairs,
        block_size,
    )
