"""Training checkpoints: atomic writes (temp dir + rename), keep-last-K, and exact resume state.

A checkpoint ``output_dir/checkpoints/step_N/`` holds the draft (the same layout as ``final/``, loadable by
``vat eval`` / ``vat export``), ``trainer_state.pt`` (optimizer, scheduler, RNG states, data position, counters,
online affinity table) and the resolved ``config.yaml``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch

from vat.errors import VatError

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    """Every RNG the training step touches."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``output_dir/checkpoints`` as ``(step, path)``, oldest first."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.exists(os.path.join(root, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def write_checkpoint(output_dir: str, step: int, write_fn, keep_last: int) -> str:
    """Write a checkpoint atomically and prune old ones.

    Args:
        output_dir: the run's output directory.
        step: optimizer step number.
        write_fn: called with a temporary directory to fill.
        keep_last: how many checkpoints to keep (0 = all).

    Returns:
        The final checkpoint directory.
    """
    root = os.path.join(output_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_fn(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep_last > 0:
        for _, path in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
    return final


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """``None`` -> None; ``auto`` -> the newest checkpoint (or None if there is none); else the given path."""
    if resume in (None, "", "none", "null"):
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1][1] if found else None
    if not os.path.exists(os.path.join(resume, STATE_FILE)):
        raise VatError(f"not a vat training checkpoint (no {STATE_FILE}): {resume}")
    return resume


def truncate_metrics(path: str, step: int) -> None:
    """Drop metrics.jsonl lines logged after ``step`` (a killed run may have logged past its last checkpoint)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(lines)
