"""The training loop both trainers run (the draft trainer, :mod:`vat.train.trainer`, and the Window Pool router
trainer, :mod:`vat.window_pool.train`): resume from the newest checkpoint, walk the bucketed batches by data
position, accumulate gradients through accelerate, one optimizer and scheduler step per step, one metrics line per
logging step, checkpoints every ``train.save_every`` steps, ``train.stop_after`` (a planned kill), the final write.

A trainer subclasses :class:`TrainLoop`, builds in its ``setup`` what the loop reads (below), and fills the hooks:
what one micro-batch computes (:meth:`TrainLoop.forward_loss`), what a step logs (:meth:`TrainLoop.step_record`)
and how its state is saved and loaded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from vat.train.checkpointing import resolve_resume, truncate_metrics
from vat.train.data import collate


@dataclass
class DataPosition:
    """Where the run is in its data: the next batch is ``batches(epoch)[batch_index]``."""

    epoch: int = 0
    batch_index: int = 0


class TrainLoop:
    """The loop of :meth:`run`. What it reads, built by the subclass's setup: ``cfg`` (``resume``, ``output_dir``,
    ``train.{grad_accum, save_every, stop_after}``, ``logging.progress``), ``accelerator``, ``optimizer``,
    ``batches`` (:class:`vat.train.data.BucketedBatches`), ``dataset``, ``pad_id``, ``device``, ``is_main``,
    ``total_steps``; it keeps ``step`` and ``position``."""

    progress_desc = "train"

    def __init__(self) -> None:
        self.step = 0
        self.position = DataPosition()
        self._batches_of_epoch: tuple[int, list[list[int]]] | None = None  # (epoch, its batches)

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def trained_module(self) -> torch.nn.Module:
        """The module accelerate accumulates gradients for."""
        raise NotImplementedError

    def step_context(self, step: int) -> Any:
        """What every micro-batch of ``step`` shares (a budget, a routing constraint; None)."""
        return None

    def forward_loss(self, batch: dict[str, torch.Tensor], context: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch: the loss to back-propagate and metric sums (tensors, summed over micro-batches)."""
        raise NotImplementedError

    def keep_micro_batch(self, loss: torch.Tensor, indices: list[int]) -> bool:
        """False skips the micro-batch (no backward): the draft trainer's non-finite rule. Default: keep."""
        return True

    def clip_gradients(self) -> dict[str, torch.Tensor]:
        """Clip before the optimizer step; returns the pre-clip norms to add to the step's metrics."""
        return {}

    def after_step(self) -> None:
        """Work once per step after its micro-batches (every rank), e.g. folding the step's routing."""

    def step_record(self, sums: dict[str, torch.Tensor], losses: list[torch.Tensor], context: Any) -> dict | None:
        """The step's metrics record, or None when the step logs nothing."""
        raise NotImplementedError

    def writes_record(self, step: int) -> bool:
        """Whether the step's record goes to metrics.jsonl."""
        return True

    def on_record(self, record: dict, bar: Any) -> None:
        """Rank 0, after a record is written: trackers, the progress bar's postfix."""

    def on_run_start(self) -> None:
        """Every rank, before the first step of this run (after resume): timers, trackers (rank 0)."""

    def load_state(self, directory: str) -> None:
        raise NotImplementedError

    def save_checkpoint(self) -> str | None:
        raise NotImplementedError

    def save_final(self, last: dict[str, Any]) -> None:
        raise NotImplementedError

    # ---- the loop ------------------------------------------------------------------------------------------------
    def next_batch(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The dataset rows at the data position, collated on the device, plus ``host_loss_mask`` and
        ``host_attention_mask``: the two masks as collated on the CPU (what the host reads, e.g. DFlash's anchor
        sampling, without a device-to-host copy); the position moves on (next epoch at the end of one)."""
        epoch_batches = self._epoch_batches(self.position.epoch)
        if self.position.batch_index >= len(epoch_batches):
            self.position = DataPosition(self.position.epoch + 1, 0)
            epoch_batches = self._epoch_batches(self.position.epoch)
        indices = epoch_batches[self.position.batch_index]
        self.position.batch_index += 1
        rows = collate([self.dataset[i] for i in indices], self.pad_id)
        batch = {k: v.to(self.device) for k, v in rows.items()}
        batch.update(host_loss_mask=rows["loss_mask"], host_attention_mask=rows["attention_mask"])
        return indices, batch

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's batches (dataset row indices), computed once per epoch."""
        if self._batches_of_epoch is None or self._batches_of_epoch[0] != epoch:
            self._batches_of_epoch = (epoch, self.batches.epoch(epoch))
        return self._batches_of_epoch[1]

    def step_scheduler(self) -> None:
        """One scheduler step per optimizer step that ran (not per micro-batch, process or skipped fp16 step)."""
        if self.accelerator.sync_gradients and not self.accelerator.optimizer_step_was_skipped:
            self.scheduler.step()

    def run(self) -> dict[str, Any]:
        """Train to ``total_steps`` (or ``train.stop_after``) from wherever the run's newest checkpoint left it;
        returns the last step's record."""
        cfg = self.cfg
        resume_dir = resolve_resume(cfg.resume, cfg.output_dir)
        if resume_dir is not None:
            self.load_state(resume_dir)
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if self.is_main:
            truncate_metrics(metrics_path, self.step)
        self.on_run_start()
        bar = tqdm(total=self.total_steps, initial=self.step, desc=self.progress_desc,
                   disable=not (self.is_main and cfg.logging.progress), dynamic_ncols=True)
        last: dict[str, Any] = {}
        stop_after = cfg.train.stop_after
        module = self.trained_module()
        while self.step < self.total_steps:
            context = self.step_context(self.step)
            sums: dict[str, torch.Tensor] = {}
            losses: list[torch.Tensor] = []
            for _ in range(cfg.train.grad_accum):
                indices, batch = self.next_batch()
                with self.accelerator.accumulate(module):
                    loss, metrics = self.forward_loss(batch, context)
                    if not self.keep_micro_batch(loss, indices):
                        self.optimizer.zero_grad(set_to_none=True)
                        continue
                    self.accelerator.backward(loss)
                    if self.accelerator.sync_gradients:
                        metrics.update(self.clip_gradients())
                    self.optimizer.step()
                    self.step_scheduler()
                    self.optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach().float())
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0) + value.detach().float()
            self.step += 1
            self.after_step()
            if not losses:  # every micro-batch skipped: nothing to log, save or count towards stop_after
                continue
            record = self.step_record(sums, losses, context)
            if record is not None:
                last = record
                if self.is_main and self.writes_record(self.step):
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                    self.on_record(record, bar)
            bar.update(1)
            if cfg.train.save_every and self.step % cfg.train.save_every == 0 and self.step < self.total_steps:
                self.save_checkpoint()
            if stop_after is not None and self.step >= stop_after:
                break
        bar.close()
        if stop_after is None or self.step >= self.total_steps:
            self.save_final(last)
        return last
