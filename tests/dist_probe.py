"""Run `vat train` (config overrides on argv) and record, on rank 0, the gradient the optimizer steps at every step.

``python -m torch.distributed.run --nproc_per_node N tests/dist_probe.py GRADS_DIR key=value ...`` (or :func:`run`
in-process for one process). The gradient is taken where the trainer clips it: after DDP's all-reduce, so it is the
global batch's gradient. ``VAT_PROBE_NAN=RANK,STEP`` makes rank RANK alone see a NaN loss at step STEP. Used by
tests/test_distributed.py; not a test module itself.
"""

from __future__ import annotations

import os
import sys

import torch


def run(grads_dir: str, overrides: list[str]) -> None:
    from vat.config import load_config
    from vat.train.distributed import end_process_group
    from vat.train.trainer import Trainer

    os.makedirs(grads_dir, exist_ok=True)
    trainer = Trainer(load_config(None, overrides))
    trainer.setup()
    clip = trainer.clip_gradients

    def recording_clip():
        if trainer.is_main:
            model = trainer.accelerator.unwrap_model(trainer.drafter)
            grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
            torch.save(grads, os.path.join(grads_dir, f"step{trainer.step + 1}.pt"))  # step counts after the loop
        return clip()

    trainer.clip_gradients = recording_clip
    nan_rank, nan_step = (int(v) for v in os.environ.get("VAT_PROBE_NAN", "-1,-1").split(","))
    if trainer.accelerator.process_index == nan_rank:  # this rank alone sees a NaN loss at step nan_step
        forward = trainer.forward_loss

        def nan_forward(batch, budget):
            loss, metrics = forward(batch, budget)
            return (loss * float("nan") if trainer.step + 1 == nan_step else loss), metrics

        trainer.forward_loss = nan_forward
    try:
        trainer.run()
    finally:
        trainer.close()
    end_process_group()  # as the CLI does after a command: no rank exits with gloo up while its peer still works


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
