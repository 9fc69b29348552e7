"""Pretraining of the tiny targets: AdamW + warmup + cosine over packed rows, resumable after a kill.

With a ``state_dir``, the model, optimizer, schedule, running losses and the step are saved there every
``save_every_seconds`` (written to a temporary file, then renamed); a later call with the same rows and spec resumes
at that step. The rows are drawn in a seeded order fixed by (rows, steps, seed), the forward has no randomness, and
the build runs with deterministic algorithms, so a resumed build ends with the weights of an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import math
import os
import time

import torch
from tqdm.auto import tqdm

from vat.errors import VatError

STATE_FILE = "pretrain_state.pt"


def lr_multiplier(step: int, total: int, spec) -> float:
    """Linear warmup then cosine decay to ``spec.min_lr_ratio`` (a multiplier of ``spec.lr``)."""
    warmup = max(1, int(total * spec.warmup_frac))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (incl. the 3-D expert weights and the LM head); none on norms and the embedding."""
    embed = model.get_input_embeddings().weight
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not embed]
    no_decay = [p for p in model.parameters() if p.dim() < 2 or p is embed]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def row_order(n_rows: int, n_needed: int, seed: int) -> torch.Tensor:
    """Row indices for ``n_needed`` draws: a fresh seeded permutation per epoch. Returns ``(n_needed,)``."""
    gen = torch.Generator().manual_seed(seed)
    epochs = -(-n_needed // n_rows)
    return torch.cat([torch.randperm(n_rows, generator=gen) for _ in range(epochs)])[:n_needed]


def _fingerprint(rows: torch.Tensor, steps: int, seed: int) -> list:
    """What a saved state must match to be resumed: the rows' shape and hash, steps, seed."""
    digest = hashlib.sha256(rows.contiguous().numpy().tobytes()).hexdigest()
    return [*rows.shape, digest, steps, seed]


def _save_state(path: str, model, opt, sched, step: int, carried: dict, fingerprint: list) -> None:
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": step, "carried": carried, "fingerprint": fingerprint,
                "rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)  # complete or absent


def _load_state(path: str, model, opt, sched, fingerprint: list) -> tuple[int, dict] | None:
    """Restore a saved state into model / optimizer / schedule; None when there is none or it is another build's."""
    if not os.path.isfile(path):
        return None
    state = torch.load(path, weights_only=False)
    if state.get("fingerprint") != fingerprint:
        return None
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["step"], state["carried"]


def pretrain(model, rows: torch.Tensor, spec, seed: int, state_dir: str | None = None,
             save_every_seconds: float = 300.0) -> dict:
    """Pretrain ``model`` on packed ``rows`` (N, T) for ``spec.train_tokens`` tokens with AdamW + cosine.

    The loss is the LM cross-entropy on every token plus ``router_aux_loss_coef`` x the load-balancing loss.
    A non-finite loss skips the step (counted); ``max_bad_steps`` in a row stop the build.

    Args:
        model: the model to train (in place).
        rows: (N, T) token ids.
        spec: the build spec (batch size, token budget, optimiser settings).
        seed: the row order's seed.
        state_dir: where the resumable state is saved and looked for (None = not resumable).
        save_every_seconds: how often the state is saved (and once more at the end).

    Returns:
        Training metrics: steps, tokens, epochs, final losses, skipped steps, seconds, and the step resumed from.
    """
    batch, seq_len = spec.batch_size, rows.shape[1]
    steps = max(1, spec.train_tokens // (batch * seq_len))
    order = row_order(rows.shape[0], steps * batch, seed)
    opt = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, steps, spec))
    fingerprint = _fingerprint(rows, steps, seed)
    state_path = os.path.join(state_dir, STATE_FILE) if state_dir else None
    carried = {"ema_lm": None, "ema_aux": None, "skipped": 0, "seconds": 0.0}
    first = 0
    if state_path is not None and (loaded := _load_state(state_path, model, opt, sched, fingerprint)) is not None:
        first, carried = loaded
    model.train()
    ema_lm, ema_aux, skipped = carried["ema_lm"], carried["ema_aux"], carried["skipped"]
    bad_in_row = 0
    start = last_save = time.perf_counter()
    bar = tqdm(range(first, steps), desc="pretrain tiny target", unit="step", dynamic_ncols=True, initial=first,
               total=steps)
    for step in bar:
        x = rows[order[step * batch : (step + 1) * batch]]  # (B, T)
        out = model(input_ids=x, labels=x, output_router_logits=True, use_cache=False)
        if not torch.isfinite(out.loss):
            skipped, bad_in_row = skipped + 1, bad_in_row + 1
            opt.zero_grad(set_to_none=True)
            if bad_in_row >= spec.max_bad_steps:
                raise VatError(f"tiny-target pretraining diverged: {bad_in_row} non-finite losses in a row at step {step}")
            continue
        bad_in_row = 0
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        aux = float(out.aux_loss.detach())
        lm = float(out.loss.detach()) - spec.router_aux_loss_coef * aux
        ema_lm = lm if ema_lm is None else 0.95 * ema_lm + 0.05 * lm
        ema_aux = aux if ema_aux is None else 0.95 * ema_aux + 0.05 * aux
        now = time.perf_counter()
        bar.set_postfix(loss=f"{ema_lm:.3f}", aux=f"{ema_aux:.3f}",
                        tok_s=f"{(step + 1 - first) * batch * seq_len / (now - start):.0f}")
        if state_path is not None and (now - last_save >= save_every_seconds or step + 1 == steps):
            _save_state(state_path, model, opt, sched, step + 1, {
                "ema_lm": ema_lm, "ema_aux": ema_aux, "skipped": skipped,
                "seconds": carried["seconds"] + now - start}, fingerprint)
            last_save = time.perf_counter()
    bar.close()
    seconds = time.perf_counter() - start
    return {
        "steps": steps,
        "tokens_trained": steps * batch * seq_len,
        "epochs": steps * batch / rows.shape[0],
        "train_rows": rows.shape[0],
        "final_train_loss": ema_lm,
        "final_aux_loss": ema_aux,
        "skipped_nonfinite_steps": skipped,
        "resumed_from_step": first,
        "train_seconds": carried["seconds"] + seconds,
        "train_tokens_per_second": (steps - first) * batch * seq_len / seconds if steps > first else None,
    }
