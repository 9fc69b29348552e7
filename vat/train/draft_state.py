"""The draft trainer's saved state (:class:`DraftCheckpoints`, a part of :class:`vat.train.trainer.Trainer`): the
draft in its release layout (adapters merged, FSDP2 shards gathered) with its affinity table and config,
``checkpoints/step_N`` with everything a resume needs (optimizer, scheduler, data position and the world size it
counts in, per-rank RNG states, affinity table, union scale), resumption at any world size, and ``final``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import save_file

from vat.config import to_yaml
from vat.errors import VatError
from vat.export.checkpoint import read_draft_config, save_draft
from vat.train.checkpointing import STATE_FILE, rng_state, set_rng_state, write_checkpoint
from vat.train.distributed import (
    full_state_dicts,
    gather_rng_states,
    load_full_state_dicts,
    pick_rng_state,
    world_size_position,
)
from vat.train.loop import DataPosition
from vat.train.lora import merged_draft


class DraftCheckpoints:
    """Saving and loading a draft-training run (the loop's ``save_checkpoint``, ``load_state`` and ``save_final``).
    Every rank calls them: under FSDP2 gathering the full state is a collective; rank 0 alone writes."""

    def _full_state(self) -> tuple[dict, dict]:
        """(model, optimizer) state to save; a collective under FSDP2 (call on every rank; rank 0 gets the tensors)."""
        model = self.accelerator.unwrap_model(self.drafter) if not self.sharded else self.drafter
        return full_state_dicts(model, self.optimizer, self.sharded)

    def _write_draft(self, directory: str, model_state: dict | None = None) -> None:
        """The draft in its release layout: adapters merged (``train.lora``), FSDP2 shards gathered (``model_state``)."""
        model = self.accelerator.unwrap_model(self.drafter)
        if self.lora_targets or self.sharded:
            model = merged_draft(model, model_state)
        save_draft(model, self.draft_config, directory)
        table = self.affinity.table().detach().float().cpu().contiguous()
        save_file({"affinity": table}, os.path.join(directory, "affinity.safetensors"))
        with open(os.path.join(directory, "config.yaml"), "w") as f:
            f.write(to_yaml(self.cfg))

    def save_checkpoint(self) -> str | None:
        """Rank 0 writes ``checkpoints/step_N`` (every rank takes part: RNG states, FSDP2 gathers)."""
        self.accelerator.wait_for_everyone()
        rng = gather_rng_states(rng_state())  # one per rank
        model_state, optim_state = self._full_state()
        if not self.is_main:
            self.accelerator.wait_for_everyone()
            return None

        def fill(tmp: str) -> None:
            self._write_draft(tmp, model_state)
            state = {
                "step": self.step,
                # per-rank batch index with the world size it counts in: resume converts it for any world size
                "position": (self.position.epoch, self.position.batch_index),
                "world_size": self.accelerator.num_processes,
                "optimizer": optim_state,
                "scheduler": self.scheduler.state_dict(),
                "drafter": model_state,  # adapters unmerged (train.lora): resume continues them
                "sharded": self.sharded,
                "lora_targets": list(self.lora_targets),
                "affinity": self.affinity.state_dict(),  # the same on every rank (folded from the global batch)
                "union_scale": self.union_scale.state_dict(),
                "rng": rng,
                "nonfinite_total": self.nonfinite_total,
            }
            torch.save(state, os.path.join(tmp, STATE_FILE))

        try:
            return write_checkpoint(self.cfg.output_dir, self.step, fill, self.cfg.train.keep_last)
        finally:
            self.accelerator.wait_for_everyone()  # no rank reads or prunes a half-written checkpoint


    def load_state(self, directory: str) -> None:
        self.kind.check(read_draft_config(directory), self.target)

        state = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=False)
        saved_lora, saved_sharded = state.get("lora_targets", []), bool(state.get("sharded", False))
        if list(saved_lora) != list(self.lora_targets):
            raise VatError(f"{directory} was trained with LoRA on {saved_lora or 'no layer'} but this run adapts "
                           f"{self.lora_targets or 'no layer'}: resume with the same train.lora")
        if saved_sharded != self.sharded:
            raise VatError(f"{directory} was saved with train.fsdp={str(saved_sharded).lower()}: resume with the same")
        model = self.accelerator.unwrap_model(self.drafter) if not self.sharded else self.drafter
        load_full_state_dicts(model, self.optimizer, state["drafter"], state["optimizer"], self.sharded)
        self.scheduler.load_state_dict(state["scheduler"])
        self.affinity.load_state_dict(state["affinity"])
        if "union_scale" in state:  # checkpoints before the warm-up scale measured s per step
            self.union_scale.load_state_dict(state["union_scale"], self.device)
        self.step = int(state["step"])
        epoch, batch_index = state["position"]
        saved_world, world = int(state.get("world_size", 1)), self.accelerator.num_processes
        batch_index, skipped = world_size_position(batch_index, saved_world, world)
        self.position = DataPosition(epoch, batch_index)
        self.nonfinite_total = int(state["nonfinite_total"])
        set_rng_state(pick_rng_state(state["rng"], self.accelerator.process_index))
        if self.is_main:
            moved = f" (saved with {saved_world} processes, now {world})" if saved_world != world else ""
            print(f"[vat] resumed from {directory} at step {self.step}{moved}")
            if skipped:
                print(f"[vat] warning: {skipped} batch(es) of epoch {epoch} skipped: {batch_index * world - skipped} "
                      f"global batches done do not divide by {world} processes")

    def save_final(self, last: dict[str, Any]) -> None:
        self.accelerator.wait_for_everyone()
        model_state = self._full_state()[0] if self.sharded else None  # a collective under FSDP2
        if not self.is_main:
            return
        final = os.path.join(self.cfg.output_dir, "final")
        tmp = final + ".tmp"

        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        self._write_draft(tmp, model_state)
        with open(os.path.join(tmp, "train_summary.json"), "w") as f:
            json.dump({"steps": self.step, "last": last, "data": self.data_path, "vocab": self.vocab_path,
                       "dropped_over_length": self.dropped_over_length}, f, indent=2)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        print(f"[vat] trained draft written to {final}")
