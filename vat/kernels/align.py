"""Group the (token, slot) pairs of a MoE forward by expert, padded per expert to the kernel's M-block size.

A forward routes T tokens to k experts each: ``topk_ids (T, k)``. Flattened, that is P = T·k *pairs*; pair ``p`` is
token ``p // k``, slot ``p % k``. The grouped GEMMs in :mod:`vat.kernels.fused_moe` run one program per (M-block,
N-block); every M-block holds pairs of a single expert, so the expert weights a launch reads are exactly the distinct
values of ``block_expert_ids``. Dropped slots carry the sentinel id ``num_experts`` (transformers' convention: its eager
experts forward skips ``expert_idx == num_experts``) and are left out here, which is how an expert budget turns into
fewer experts read.

Layout (vLLM ``moe_align_block_size`` style, but sized by the experts that can be present rather than by
``num_experts``, and without a host sync so the CPU can keep queueing kernels):

- ``sorted_pair_ids (max_blocks * BM,)``: pair ids grouped by ascending expert id, ascending pair id inside an expert,
  each expert's run padded to a multiple of ``BM`` with the pad value P; slots past the last real block also hold P.
- ``block_expert_ids (max_blocks,)``: the expert of each M-block; ``-1`` for the unused tail (programs exit at once).
- ``num_tokens_post_padded (1,)``: the padded length actually used, on the ids' device.

``max_blocks = min(P, ceil(P / BM) + min(E, P))`` bounds the blocks of any routing: an expert with ``c`` pairs needs
``ceil(c / BM) <= c / BM + 1`` blocks, and at most ``min(E, P)`` experts are present (and every used block holds at
least one pair). So the grid never exceeds what P allows, however large E is (DeepSeek-V3's 256 experts at P = 64
give 64 blocks, not 256 + ...); an expert budget B shrinks the *used* blocks to ≈ B at verification sizes (one per
selected expert), which is what bounds the weight bytes read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vat.errors import VatError


@dataclass(frozen=True)
class Alignment:
    """Pairs grouped by expert and padded per expert to ``block_size``.

    Attributes:
        sorted_pair_ids: ``(max_blocks * block_size,)`` int32 pair ids; padding slots hold ``num_pairs``.
        block_expert_ids: ``(max_blocks,)`` int32 expert id of each M-block, ``-1`` for unused blocks.
        num_tokens_post_padded: ``(1,)`` int32, the used length of :attr:`sorted_pair_ids` (device-side).
        num_pairs: P = T·k, also the pad value.
        block_size: the M-block size BM the ids are padded to.
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    num_pairs: int
    block_size: int

    @property
    def max_blocks(self) -> int:
        """M extent of the launch grid (an upper bound on the used blocks, known without a host sync)."""
        return int(self.block_expert_ids.numel())

    def used(self) -> tuple[list[int], list[int]]:
        """``(sorted_pair_ids, block_expert_ids)`` of the used blocks only, as host lists (host sync; for tests)."""
        n_blocks = int(self.num_tokens_post_padded.item()) // self.block_size
        return self.sorted_pair_ids[: n_blocks * self.block_size].tolist(), self.block_expert_ids[:n_blocks].tolist()

    def experts_read(self) -> list[int]:
        """Sorted ids of the experts whose weights a launch over this alignment reads (host sync)."""
        return sorted(set(self.block_expert_ids.tolist()) - {-1})


def max_blocks_bound(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Upper bound on the M-blocks of any routing of ``num_pairs`` pairs over ``num_experts`` experts."""
    return min(num_pairs, -(-num_pairs // block_size) + min(num_experts, num_pairs))


def _check_ids(topk_ids: torch.Tensor) -> None:
    if topk_ids.dim() != 2:
        raise VatError(f"topk_ids must be (num_tokens, top_k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise VatError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> Alignment:
    """Group the pairs of ``topk_ids`` by expert, padded per expert to ``block_size`` (sentinel slots skipped).

    No host sync on CUDA (so the forward is CUDA-graph capturable): buffers are sized by :func:`max_blocks_bound`.
    Ids outside ``[0, num_experts]`` raise a :class:`VatError` on CPU; on CUDA they trip the device-side bounds
    assertion of the counting scatter (checking on the host would cost a sync per layer).

    Args:
        topk_ids: ``(T, k)`` integer expert ids in ``[0, num_experts]``; ``num_experts`` marks a dropped slot.
        num_experts: E, the number of experts of the layer.
        block_size: BM, the M-block size of the kernel that will consume the alignment.

    Returns:
        The :class:`Alignment`.
    """
    _check_ids(topk_ids)
    if block_size < 1:
        raise VatError(f"block_size must be positive, got {block_size}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # (P,)
    num_pairs = flat.numel()
    if device.type == "cpu":  # free to check here; on CUDA the scatter below bounds-checks on the device
        in_range = (flat >= 0) & (flat <= num_experts)  # (P,)
        if not bool(in_range.all()):
            bad = flat[~in_range][0].item()
            raise VatError(
                f"expert id {bad} out of range: ids must lie in [0, {num_experts}] ({num_experts} = dropped)"
            )

    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E + 1,) last bin = dropped slots; bad ids assert
    counts = counts[:num_experts]  # (E,)
    blocks_per_expert = (counts + block_size - 1) // block_size  # (E,)
    block_end = torch.cumsum(blocks_per_expert, 0)  # (E,) exclusive end block of each expert
    padded_start = (block_end - blocks_per_expert) * block_size  # (E,)
    unpadded_start = torch.cumsum(counts, 0) - counts  # (E,)
    max_blocks = max_blocks_bound(num_pairs, num_experts, block_size)
    capacity = max_blocks * block_size

    order = torch.argsort(flat, stable=True)  # (P,) pair ids, grouped by expert, sentinels last
    sorted_e = flat[order]  # (P,)
    valid = sorted_e < num_experts  # (P,)
    e_safe = sorted_e.clamp(max=num_experts - 1)  # (P,)
    rank = torch.arange(num_pairs, device=device) - unpadded_start[e_safe]  # (P,) position inside its expert
    dest = torch.where(valid, padded_start[e_safe] + rank, capacity)  # (P,) dropped pairs -> dump slot

    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_idx = torch.arange(max_blocks, device=device)  # (max_blocks,)
    block_expert_ids = torch.searchsorted(block_end, block_idx, right=True)  # (max_blocks,) E past the last block
    block_expert_ids = torch.where(block_expert_ids < num_experts, block_expert_ids, -1).to(torch.int32)
    num_post_padded = (block_end[-1:] * block_size).to(torch.int32)  # (1,)
    return Alignment(sorted_pair_ids[:capacity], block_expert_ids, num_post_padded, num_pairs, block_size)


def align_block_size_reference(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> Alignment:
    """Slow, obvious version of :func:`align_block_size` (Python loops, exact sizes, no unused blocks)."""
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
        torch.tensor([len(sorted_ids)], dtype=torch.int32),
        num_pairs,
        block_size,
    )
