"""Multi-process pieces of the trainer that make a run's numbers independent of the world size (README: multi-GPU).

* :func:`gather_rows`: every rank's rows of a tensor, concatenated in rank order (variable length per rank) — the
  online affinity table folds the whole global batch's routing on every rank, so all ranks hold the same table;
* :func:`world_size_position`: the data position of a checkpoint taken with ``saved_world`` processes, for a run with
  ``world`` processes (the position counts global batches);
* :func:`gather_rng_states` / :func:`pick_rng_state`: each rank's RNG state saved and restored;
* :func:`full_state_dicts` / :func:`load_full_state_dicts`: model and optimizer state as full (unsharded) tensors on
  rank 0 under FSDP2, so a sharded run's checkpoint resumes at any world size; plain state dicts under DDP;
* :func:`fsdp2_plugin`: accelerate's FSDP plugin for ``train.fsdp``;
* :func:`end_process_group`: every rank waits for the others, then tears the default group down (the CLI calls it
  when the command that brought the group up has finished).

Launch: ``accelerate launch [--num_processes N] -m vat train RECIPE`` (README "Multi-GPU and multi-node").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from vat.errors import VatError


def world() -> int:
    """Processes in the default group (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def end_process_group(wait: bool = True) -> None:
    """Barrier (``wait``), then ``destroy_process_group``; nothing when not distributed.

    Without it a rank that finishes first (every rank but 0 returns while rank 0 writes the final draft) exits with
    gloo still up while its peer works, and the C++ teardown at interpreter exit can abort ("terminate called
    without an active exception"), which torchrun reports as a failed run. ``wait=False`` after an error: the
    teardown is local (gloo ends at once; a peer in a collective gets "connection closed" instead of a hang).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait:
        dist.barrier()
    dist.destroy_process_group()


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """All ranks' ``(n_r, ...)`` tensors concatenated along dim 0 in rank order; ``n_r`` may differ per rank.

    A collective: every rank must call it. With one process, ``tensor`` itself.
    """
    if world() == 1:
        return tensor
    n = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world())]
    dist.all_gather(sizes, n)
    longest = int(max(int(s) for s in sizes))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])


def world_size_position(batch_index: int, saved_world: int, world_size: int) -> tuple[int, int]:
    """Per-rank batch index for ``world_size`` processes after ``batch_index`` per-rank batches on ``saved_world``.

    Rank r of W runs the epoch's global batches ``r, r + W, ...``, so ``batch_index * saved_world`` global batches are
    done. Returns ``(new_batch_index, skipped)``: when that count does not divide by ``world_size`` the run rounds up
    and skips ``skipped`` global batches (never repeats one).
    """
    done = batch_index * saved_world
    new = -(-done // world_size)
    return new, new * world_size - done


def gather_rng_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's RNG state (``state`` is this rank's), in rank order; a collective."""
    if world() == 1:
        return [state]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, state)
    return out


def pick_rng_state(saved: Any, rank: int) -> dict[str, Any]:
    """This rank's saved RNG state: its own when the checkpoint has one per rank, else rank ``rank % saved``'s."""
    if isinstance(saved, dict):  # checkpoints before per-rank states
        return saved
    return saved[rank % len(saved)]


def full_state_dicts(model: torch.nn.Module, optimizer: Any, sharded: bool) -> tuple[dict, dict]:
    """``(model state, optimizer state)`` to save.

    DDP (``sharded=False``): the unwrapped model's and the optimizer's own state dicts (every rank holds all of it).
    FSDP2: full, unsharded tensors on CPU, keyed by parameter name (torch.distributed.checkpoint's full state dict);
    a collective, rank 0 gets the tensors, the others empty dicts.
    """
    if not sharded:
        return model.state_dict(), optimizer.state_dict()

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optim, options=options)
    # measured (torch 2.13, fully_shard on the root): the "full" dicts may still hold DTensors; gather what is left
    keep = dist.get_rank() == 0
    return _full_tensors(model_state, keep), _full_tensors(optim_state, keep)


def _copy_containers(tree: Any) -> Any:
    """``tree`` with new dicts and lists (the tensors shared)."""
    if isinstance(tree, Mapping):
        return {k: _copy_containers(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy_containers(v) for v in tree)
    return tree


def _full_tensors(tree: Any, keep: bool) -> Any:
    """``tree`` with every DTensor gathered to a full CPU tensor (a collective, in the tree's order on every rank);
    ``keep=False`` drops the result (ranks other than 0)."""
    if isinstance(tree, Mapping):
        out = {k: _full_tensors(v, keep) for k, v in tree.items()}
        return out if keep else {}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_full_tensors(v, keep) for v in tree)
    if hasattr(tree, "full_tensor"):
        return tree.full_tensor().cpu()
    return tree.cpu() if isinstance(tree, torch.Tensor) else tree


def load_full_state_dicts(model: torch.nn.Module, optimizer: Any, model_state: dict, optim_state: dict,
                          sharded: bool) -> None:
    """Inverse of :func:`full_state_dicts` (every rank passes the full dicts read from the checkpoint)."""
    if not sharded:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return

    options = StateDictOptions(full_state_dict=True)
    optim = getattr(optimizer, "optimizer", optimizer)
    # torch.distributed.checkpoint shards the dicts it is given in place: hand it copies of the containers
    model_state, optim_state = _copy_containers(model_state), _copy_containers(optim_state)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optim, optim_state, options=options)


def fsdp2_plugin(on_gpu: bool):
    """accelerate's FSDP2 plugin for ``train.fsdp`` (the whole draft is one shard unit; frozen and trainable weights
    may share it, as LoRA needs). Accelerate shards only on accelerators: CPU processes always run DDP (gloo)."""
    if not on_gpu:
        raise VatError("train.fsdp needs GPUs (accelerate runs CPU processes as DDP over gloo); "
                       "set train.fsdp=false on CPU")

    return FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="no_wrap",
                                          state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False)
