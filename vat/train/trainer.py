"""`vat train RECIPE.yaml [key=value ...]`: train an EAGLE-3 or DFlash draft (baseline or VAT) against a frozen MoE
target.

One step (online mode): the frozen target runs once under ``torch.no_grad`` — windowed-budgeted on the response
positions when ``budget.B`` is set (the prompt is prefilled with natural routing, as served) — and gives the aux features, the logits and the executed routing; the draft runs its
training forward (EAGLE-3: the training-time-test unroll; DFlash: one block per sampled anchor), which
:mod:`vat.slots` puts in the shared (B, anchors, K) slot layout; :func:`vat.losses.vat_objective` simulates
verification and returns the loss and metric sums; accelerate handles devices, mixed precision, gradient
accumulation and DDP.

``main(cfg)`` is setup -> run -> cleanup; the CLI only builds the config.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from typing import Any

import torch
from omegaconf import OmegaConf

from vat.config import load_config
from vat.data_prep.capture_store import CaptureReader
from vat.errors import VatError
from vat.losses import binary_auc, finalize_metrics, vat_objective
from vat.train.distributed import gather_rows
from vat.train.draft_state import DraftCheckpoints
from vat.train.kinds import drafter_kind
from vat.train.loop import TrainLoop
from vat.train.setup import TrainerSetup
from vat.verify import simulate_verification, target_dist


def cli_main(args) -> int:
    """`vat train` entry: build the config from the recipe and overrides, then :func:`main`."""
    cfg = load_config(args.recipe, args.overrides)
    if cfg.kind == "window_pool":  # continued pretraining of the target's routers (vat/window_pool, docs/window_pool.md)
        from vat.window_pool.train import main as window_pool_main

        window_pool_main(cfg)
        return 0
    main(cfg)
    return 0


class Trainer(TrainerSetup, DraftCheckpoints, TrainLoop):
    """Holds everything one training run needs; built by :meth:`setup` (:mod:`vat.train.setup`), driven by
    :meth:`run` (:mod:`vat.train.loop`), saved and resumed by :mod:`vat.train.draft_state`; this module is the step.

    Args:
        cfg: the resolved :class:`vat.config.VatConfig`.
    """

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg
        self.nonfinite_total = 0
        self.nonfinite_streak = 0
        self.tracker = None
        self.vh_pairs: list[tuple[torch.Tensor, ...]] = []  # (VH logits, survival, observed) since the last log
        self.pending_routing: list[tuple[torch.Tensor, torch.Tensor]] = []  # this step's (rows, topk_ids), per batch
        self.sharded = False
        self.capture: CaptureReader | None = None  # data.capture: the target's features read, not computed
        self.kind = drafter_kind(cfg.drafter.kind)  # an unknown kind stops here, before anything loads

    # ---- one step ------------------------------------------------------------------------------------------------
    def _budget_for_step(self, step: int):
        """The step's budget with a random window offset (seeded by step, so a resumed run draws the same)."""
        if self.budget is None:
            return None
        rng = random.Random(self.budget_rng_seed + step)
        if rng.random() < self.cfg.budget.train_mix:
            return None
        return replace(self.budget, offset=rng.randrange(self.budget_window))

    def _draft_slots(self, batch: dict[str, torch.Tensor], tout, dist):
        """The draft's training forward on a batch, in the (B, anchors, K) slot layout of :mod:`vat.slots`. On data
        that is not the target's own, the simulated chain leaves real verification at the first data token that is
        not the target's argmax (``loss.onpolicy_chain``): later slots are censored, not rejected
        (docs/vat_losses.md). Sampled anchors are seeded by the global data position (not the global RNG, not the
        rank): a resumed run, and a run at another world size, draws the same."""
        anchor_seed = self.cfg.seed * 1_000_003 + 7919 * self.position.epoch + self._global_batch_index() + 1
        return self.kind.training_slots(self.drafter, self.draft_config, self.cfg, batch, tout, dist,
                                        self.target.num_experts, anchor_seed, self.accelerator.autocast)

    def next_batch(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The loop's batch; with ``data.capture`` also its captured features (``captured_aux``, ``captured_last``,
        ``captured_routing``), read for the same rows in the same order."""
        indices, batch = super().next_batch()
        if self.capture is not None:
            features = self.capture.batch([self.capture_rows[i] for i in indices], batch["input_ids"],
                                          self.target.num_experts)
            batch.update({f"captured_{k}": v.to(self.device) for k, v in features.items() if v is not None})
        return indices, batch

    def _target_forward(self, batch: dict[str, torch.Tensor], budget):
        """The step's one target forward. Under a budget only the response (loss-masked) positions are budgeted:
        as served, the prompt — and every later user turn — is prefilled with natural routing, and only the
        verification forwards over the model's own answer run under the budget (docs/vat_losses.md). The prompt positions'
        hidden states, logits and routing are therefore the unbudgeted forward's exactly (causal attention)."""
        if self.capture is not None:  # the same output from the captured features (no budget: refused at setup)
            return self.target.forward_features(batch["captured_aux"], batch["captured_last"],
                                                batch.get("captured_routing"))
        input_ids, attention = batch["input_ids"], batch["attention_mask"]
        token_mask = None
        if budget is not None:
            token_mask = attention.bool() & batch["loss_mask"].bool()  # (B, T) budgeted positions
            # rows that share one window set (scope batch) cannot each restart at their own response
            if self.cfg.budget.align == "response" and budget.phase is None and budget.scope == "sequence":
                budget = replace(budget, phase=self._window_phases(input_ids.shape[0]))
        return self.target.forward(input_ids, attention_mask=attention, token_mask=token_mask, budget=budget)

    def _window_phases(self, rows: int) -> tuple[int, ...]:
        """``budget.align: response``: one window phase per row, uniform in [0, W), seeded by the step and the data
        position (a resumed run draws the same). Windows restart at every response segment, where serving's first
        verification block of the turn starts, and each anchor starts a whole window in 1/W of the steps, per row
        independently (docs/vat_losses.md, "Budget windows")."""
        gen = torch.Generator().manual_seed(self.budget_rng_seed + 7919 * self.step
                                            + 104_729 * (self._global_batch_index() + 1))
        return tuple(torch.randint(self.budget_window, (rows,), generator=gen).tolist())

    def _global_batch_index(self) -> int:
        """The epoch-wide index of the micro-batch just taken: rank r's i-th batch is batch i * world + r of the
        epoch (BucketedBatches), one process's i-th is batch i. Seeds drawn from it make a run the same at any
        world size (one process with grad_accum = world sees the same batches in the same order)."""
        return (self.position.batch_index - 1) * self.accelerator.num_processes + self.accelerator.process_index

    def forward_loss(self, batch: dict[str, torch.Tensor], budget) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        input_ids, attention = batch["input_ids"], batch["attention_mask"]
        tout = self._target_forward(batch, budget)
        # p itself only for the soft CE and non-greedy acceptance; argmax and mass otherwise (no (B, T, V) fp32)
        needs_probs = bool(self.switches.soft_weight) or self.switches.acceptance != "greedy"
        dist = target_dist(tout.logits, self.draft_to_target, with_probs=needs_probs)  # fields (B, T, ·)
        slots = self._draft_slots(batch, tout, dist)  # (B, A, K, ·)
        valid, censored = slots.valid, slots.censored
        topk = tout.topk_ids  # (L', B, T, k)
        verification = simulate_verification(slots.logits, slots.target, valid, acceptance=self.switches.acceptance,
                                             censored=censored)
        if censored is not None:
            metrics_extra = {"censored_sum": (censored & valid).float().sum(), "censored_count": valid.float().sum()}
        else:
            metrics_extra = {}
        vh_logits = slots.vh_logits  # (B, A, K) or None
        # the union term's work (expected expert use over the draft vocab, soft union, its sampled anchors) runs when
        # it is penalised, else only on the steps that log its metric (union_sim): at λ = 0 it changes no gradient
        union = (bool(self.switches.union_weight) or self._logs_at(self.step + 1)) and topk is not None
        loss, metrics = vat_objective(
            slots.logits, slots.imitation, valid, self.switches, vh_logits=vh_logits,
            affinity=self.affinity.table() if union else None,
            anchor_routing=self._tracked_layers(slots.anchor_routing) if union else None,
            verification=verification,
            union_anchors=self._union_anchors(verification.anchor_valid) if union else None,
            union_scale=self.union_scale, measure_pull=self._logs_at(self.step + 1),
        )
        if vh_logits is not None:  # kept for an exact AUC over the logging window (masked there: no sync per batch)
            self.vh_pairs.append((vh_logits.detach().float(), verification.survival.detach().float(),
                                  verification.valid.detach()))
        if topk is not None:  # routing known (always, but from a capture without it)
            self._queue_routing(input_ids, attention, topk if tout.natural_topk_ids is None else tout.natural_topk_ids)
        metrics.update(metrics_extra)
        metrics["tokens"] = attention.sum().float()
        return loss, metrics

    def _queue_routing(self, input_ids: torch.Tensor, attention: torch.Tensor, natural: torch.Tensor) -> None:
        """The micro-batch's natural routing ``(L', B, T, k)``, queued for this step's fold into the affinity table. The
        table learns natural routing (docs/vat_losses.md): under a budget, each router's own top-k of this same forward
        (captured before the budget rerouted it), not the budgeted ids the union term's anchor routing uses."""
        rows = self.target_to_draft[input_ids]  # (B, T) draft id of each input token, -1 outside
        dropped_as_negative = natural.masked_fill(natural >= self.target.num_experts, -1)
        self.pending_routing.append(self.affinity.select(rows, dropped_as_negative, attention.bool()))

    def _logs_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based: the loop counts a step once its micro-batches ran) writes a
        metrics record."""
        return step % self.cfg.train.log_every == 0 or step == self.total_steps

    def _tracked_layers(self, anchor_routing: torch.Tensor) -> torch.Tensor:
        """``(..., L', E)`` -> the affinity table's layers (all, or every s-th with ``loss.affinity_layer_stride``)."""
        index = self.affinity.layer_index
        if len(index) == anchor_routing.shape[-2]:
            return anchor_routing
        return anchor_routing[..., index, :]  # (..., L'', E)

    def _fold_affinity(self) -> None:
        """Fold the step's routing (every micro-batch of every rank, in rank order) into the online affinity table
        once: each rank then holds the table one process builds from the same global batch (README: multi-GPU)."""
        pending, self.pending_routing = self.pending_routing, []
        if bool(self.affinity.frozen) or not pending:
            return
        rows = torch.cat([r for r, _ in pending])  # (n,)
        ids = torch.cat([i for _, i in pending])  # (n, L', k)
        n, L, k = ids.shape
        flat = gather_rows(torch.cat([rows.view(-1, 1), ids.reshape(n, L * k)], dim=1).to(torch.int32))
        self.affinity.fold(flat[:, 0].long(), flat[:, 1:].long().view(-1, L, k))
        self.union_scale.informative = True  # the table has seen routing: its union gradient is a direction

    def _union_anchors(self, anchor_valid: torch.Tensor) -> torch.Tensor | None:
        """A seeded sample of valid anchors for the union term (all of them when they fit ``union_max_anchors``)."""
        cap = self.cfg.loss.union_max_anchors
        flat = anchor_valid.reshape(-1).nonzero().squeeze(-1)  # (n,)
        if not cap or flat.numel() <= cap:
            return flat
        gen = torch.Generator().manual_seed(self.budget_rng_seed + 7919 * self.step
                                            + 104_729 * (self._global_batch_index() + 1))  # per micro-batch, any world
        return flat[torch.randperm(flat.numel(), generator=gen)[:cap].to(flat.device)]

    # ---- the loop ------------------------------------------------------------------------------------------------
    # ---- the loop's hooks (vat.train.loop) --------------------------------------------------------------------------
    def trained_module(self) -> torch.nn.Module:
        return self.drafter

    def step_context(self, step: int):
        return self._budget_for_step(step)

    def keep_micro_batch(self, loss: torch.Tensor, indices: list[int]) -> bool:
        if not self._all_ranks_finite(loss):  # skipped by every rank together, or none: no hang
            self._nonfinite(indices)
            return False
        self.nonfinite_streak = 0
        return True

    def after_step(self) -> None:
        # the step's union gradient norms, summed over the ranks, join the scale's warm-up (before this step's fold
        # makes a fresh table informative: the scale measures from the first step that ran on an informative table)
        reduce_sum = None
        if self.accelerator.num_processes > 1:
            reduce_sum = lambda t: self.accelerator.reduce(t.to(self.device), reduction="sum")  # noqa: E731
        self.union_scale.commit(reduce_sum, self.device)
        self._fold_affinity()

    def on_run_start(self) -> None:
        if self.is_main:
            self._init_tracker()
        self.window_start, self.window_tokens = time.time(), 0.0

    def step_record(self, sums: dict[str, torch.Tensor], losses: list[torch.Tensor], context) -> dict | None:
        """Reduced across processes on logging steps only; tokens/s over the steps since the last record."""
        self.window_tokens += float(sums.get("tokens", 0.0))
        if not self._logs_at(self.step):
            return None
        record = self._reduce(sums, torch.stack(losses).mean())
        elapsed = max(time.time() - self.window_start, 1e-9)
        record["tokens_per_s"] = self.window_tokens * self.accelerator.num_processes / elapsed
        self.window_start, self.window_tokens = time.time(), 0.0
        return record

    def on_record(self, record: dict, bar) -> None:
        if self.tracker is not None:
            self.tracker.log(record, step=self.step)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau_sim']:.2f}",
                        tok_s=f"{record['tokens_per_s']:.0f}")

    def clip_gradients(self) -> dict[str, torch.Tensor]:
        """Clip the body and the verification head each to its own norm; return both pre-clip norms."""
        self.accelerator.unscale_gradients()  # once: a no-op unless fp16 with a grad scaler
        clip = torch.nn.utils.clip_grad_norm_
        norms = {"grad_norm": clip(self.body_params, self.cfg.train.grad_clip)}
        if self.vh_params:
            norms["vh_grad_norm"] = clip(self.vh_params, self.cfg.train.vh_grad_clip)
        # under FSDP2 the norm is a DTensor (already reduced over the shards)
        return {k: torch.as_tensor(float(v.full_tensor() if hasattr(v, "full_tensor") else v)) for k, v in norms.items()}

    def _all_ranks_finite(self, loss: torch.Tensor) -> bool:
        """Whether the micro-batch's loss is finite on every process.

        Each rank deciding alone would hang multi-process training: a rank that skips ``backward`` never joins the
        gradient all-reduce (DDP) or reduce-scatter (FSDP2) the others wait in. One all-reduce of a flag makes the
        decision global; a single process pays nothing beyond the local check.
        """
        finite = torch.isfinite(loss.detach()).reshape(1).float()
        if self.accelerator.num_processes > 1:
            finite = self.accelerator.reduce(finite, reduction="sum") / self.accelerator.num_processes
        return bool(finite.item() == 1.0)

    def _nonfinite(self, indices: list[int]) -> None:
        self.nonfinite_total += 1
        self.nonfinite_streak += 1
        if self.nonfinite_streak >= self.cfg.train.max_nonfinite:
            ids = [self.dataset[i].get("id", i) for i in indices]
            raise VatError(
                f"{self.nonfinite_streak} non-finite losses in a row at step {self.step + 1} "
                f"(epoch {self.position.epoch}, batch {self.position.batch_index - 1}, sample ids {ids[:8]})"
            )

    def _reduce(self, sums: dict[str, torch.Tensor], loss: torch.Tensor) -> dict[str, Any]:
        """Global sums across processes -> one metrics record (ratios of sums, never means of means)."""
        reduced = {
            key: self.accelerator.reduce(torch.as_tensor(value, device=self.device).float(), reduction="sum")
            for key, value in sorted(sums.items())
        }
        loss = self.accelerator.reduce(loss.to(self.device), reduction="mean")
        record: dict[str, Any] = {"step": self.step, "loss": float(loss)}
        finalized = finalize_metrics(reduced)
        if "objective" in finalized:  # the union term unscaled (union_scale is logged beside it)
            record["loss"] = float(finalized.pop("objective"))
        if (finalized.get("union_clamped") or 0) > 0 and self.is_main and not self.union_bound_reported:
            self.union_bound_reported = True
            print(f"[vat] step {self.step}: the union scale hit its guard loss.union_scale_max="
                  f"{self.switches.union_scale_max:g} (unbounded {finalized.get('union_scale_raw', float('nan')):.3g}):"
                  f" the union pulls with less than λ = {self.switches.union_weight:g} (union_lambda_eff)")
        for key, value in finalized.items():
            if isinstance(value, (list, tuple)):  # per-step lists -> acc_0 ... acc_{K-1}
                base = key[:-2] if key.endswith("_k") else key
                record.update({f"{base}_{i}": _finite_or_none(v) for i, v in enumerate(value)})
            else:
                record[key] = _finite_or_none(value)
        record["lr"] = float(self.scheduler.get_last_lr()[0])
        for key in ("grad_norm", "vh_grad_norm"):  # identical on every rank after the all-reduce of gradients
            if key in reduced:
                record[key] = float(reduced[key]) / self.accelerator.num_processes
        record["tokens"] = float(reduced.get("tokens", 0.0))
        if self.vh_pairs:
            record["vh_auc"] = _finite_or_none(self._vh_auc())
        record["nonfinite_skipped"] = self.nonfinite_total
        record["epoch"] = self.position.epoch
        return record

    def _vh_auc(self) -> float:
        """Exact ROC AUC of the verification head over every rank's positions since the last log."""
        scores = torch.cat([p[0][p[2]] for p in self.vh_pairs]).to(self.device)  # observed positions only
        labels = torch.cat([p[1][p[2]] for p in self.vh_pairs]).to(self.device)
        self.vh_pairs.clear()
        if self.accelerator.num_processes > 1:
            scores = self.accelerator.pad_across_processes(scores, pad_index=float("nan"))
            labels = self.accelerator.pad_across_processes(labels, pad_index=float("nan"))
            scores, labels = self.accelerator.gather(scores), self.accelerator.gather(labels)
            keep = ~torch.isnan(labels)
            scores, labels = scores[keep], labels[keep]
        return binary_auc(scores, labels)

    def _init_tracker(self) -> None:
        mode = self.cfg.logging.wandb.mode
        if mode == "disabled":
            return
        if mode not in ("offline", "online"):
            raise VatError(f"logging.wandb.mode must be disabled, offline or online, got `{mode}`")
        import wandb

        self.tracker = wandb.init(
            project=self.cfg.logging.wandb.project, name=self.cfg.logging.wandb.name, mode=mode,
            dir=self.cfg.output_dir, config=OmegaConf.to_container(self.cfg, resolve=True),
        )

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()
        self.target.close()


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN: an undefined ratio (0 / 0) is logged as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main(cfg: Any) -> dict[str, Any]:
    """Train a draft: setup -> run -> cleanup. Returns the last logged metrics."""
    trainer = Trainer(cfg)
    trainer.setup()
    try:
        return trainer.run()
    finally:
        trainer.close()
