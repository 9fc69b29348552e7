"""Run `vat train` (config overrides on argv) and record, on rank 0, the gradient the optimizer steps at every step.

``python -m torch.distributed.run --nproc_per_node N tests/dist_probe.py GRADS_DIR key=value ...`` (or :func:`run`
in-process for one process). The gradient is taken where the trainer clips it: after DDP's all-reduce, so it is the
global batch's gradient. Used by tests/test_distributed.py; not a test module itself.
"""

from __future__ import annotations

import os
import sys

import torch


def run(grads_dir: str, overrides: list[str]) -> None:
    from vat.config import load_config
    from vat.trainer import Trainer

    os.makedirs(grads_dir, exist_ok=True)
    trainer = Trainer(load_config(None, overrides))
    trainer.setup()
    clip = trainer._clip_gradients

    def recording_clip():
        if trainer.is_main:
            model = trainer.accelerator.unwrap_model(trainer.drafter)
            grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
            torch.save(grads, os.path.join(grads_dir, f"step{trainer.step + 1}.pt"))  # step counts after the loop
        return clip()

    trainer._clip_gradients = recording_clip
    try:
        trainer.run()
    finally:
        trainer.close()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
