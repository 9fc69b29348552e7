"""`vat train RECIPE.yaml` with ``kind: window_pool``: continued pretraining of an MoE target's routers (docs/window_pool.md).

Every step draws a constraint (:func:`vat.window_pool.pools.draw_constraint`): with probability
``window_pool.unconstrained_frac`` natural routing, otherwise windows of W positions (random offset) whose tokens
route inside a pool of d_w experts on the constrained layers, the pool being the MoE-Spec budget set of the window
(:mod:`vat.target.budget`, through the target's one router hook). The loss is the LM loss (next-token cross-entropy
on every real token, or the data's loss mask) plus the target's load-balancing loss (its
``router_aux_loss_coef``, computed by transformers from ``output_router_logits``) plus, when
``window_pool.pool_weight > 0``, the router mass outside each token's pool. Only the router gates train (and LoRA
adapters through ``peft`` when ``window_pool.lora`` is set); everything else is frozen.

Output: ``output_dir/final/``, a target directory (``save_pretrained`` + the tokenizer, adapters merged) that
``AutoModelForCausalLM`` loads and every vat command takes as ``--target`` / ``target.path``; checkpoints
(``checkpoints/step_N``, atomic, keep-last-K) hold the trainable weights, optimizer, scheduler, RNG and data position,
so ``resume=auto`` continues to the same numbers. ``main(cfg)`` is setup -> run -> cleanup.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from transformers import AutoTokenizer, get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from vat.config import to_yaml
from vat.errors import VatError
from vat.target import load_target
from vat.target.budget import window_groups
from vat.train.checkpointing import (
    STATE_FILE,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from vat.train.data import BucketedBatches
from vat.train.loop import DataPosition, TrainLoop
from vat.window_pool.data import training_rows
from vat.window_pool.pools import check_ranges, draw_constraint, pool_mass

SUMMARY_FILE = "window_pool.json"


def router_parameter_names(model: torch.nn.Module, routers: list[torch.nn.Module]) -> list[str]:
    """Qualified names of the router gates' parameters (weight, and bias where the family has one)."""
    ids = {id(p) for r in routers for p in r.parameters(recurse=False)}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def lm_loss_sums(logits: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and the number of predicted tokens.

    Args:
        logits: (B, T, V) logits.
        input_ids: (B, T) tokens.
        valid: (B, T) bool, tokens that count as targets (position t predicts token t+1; ``valid[:, 0]`` is unused).

    Returns:
        ``(nll_sum () fp32, count () fp32)``.
    """
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:], reduction="none"
    )  # (B, T-1)
    keep = valid[:, 1:]
    return (nll * keep).sum(), keep.sum().float()


class WindowPoolTrainer(TrainLoop):
    """One Window Pool run: built by :meth:`setup`, driven by :meth:`run`.

    Args:
        cfg: the resolved :class:`vat.config.VatConfig` (``kind: window_pool``).
    """

    progress_desc = "window_pool"

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg
        self.tokens_seen = 0.0
        self.cpu_seconds_before = 0.0  # CPU time of earlier runs of this output_dir (resume)

    # ---- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        wp = cfg.window_pool
        if cfg.train.init_from or cfg.train.lora is not None:
            raise VatError("kind: window_pool trains the target itself: train.init_from / train.lora are draft keys "
                           "(use window_pool.lora for target adapters)")
        if cfg.budget.B is not None:
            raise VatError("kind: window_pool draws its own constraints (window_pool.windows / pools): unset budget.B")
        mixed = cfg.train.mixed_precision
        if mixed == "auto":
            mixed = "bf16" if torch.cuda.is_available() else "no"
        self.accelerator = Accelerator(mixed_precision=mixed, gradient_accumulation_steps=cfg.train.grad_accum,
                                       cpu=not torch.cuda.is_available())
        set_seed(cfg.seed)
        self.device = self.accelerator.device
        self.is_main = self.accelerator.is_main_process
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.target = load_target(cfg.target.path, dtype=cfg.target.dtype, device=self.device,
                                  experts_impl=cfg.target.experts_impl, device_map=cfg.target.device_map)
        self.routing = self.target.routing
        check_ranges(wp, self.target.num_experts, self.target.moe_layer_ids)
        model = self.target.model
        model.requires_grad_(False)
        routers = [router for _, router, _ in self.routing.moe_layers]
        self.router_names = router_parameter_names(model, routers)
        if wp.lora is not None:
            model = self._apply_lora(model)
        if wp.train_routers:
            for router in routers:
                for param in router.parameters(recurse=False):
                    param.requires_grad_(True)
        self.model = model
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if not self.trainable:
            raise VatError("kind: window_pool has nothing to train: set window_pool.train_routers or window_pool.lora")
        coef = wp.aux_loss_coef if wp.aux_loss_coef is not None else getattr(self.target.config,
                                                                                "router_aux_loss_coef", 0.0)
        self.aux_coef = float(coef or 0.0)
        self._setup_data()
        self._setup_optimizer()
        if self.is_main:
            n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
            n_all = sum(p.numel() for p in model.parameters())
            print(f"[vat] window_pool: {n_train:,} of {n_all:,} target parameters train ({len(self.trainable)} "
                  f"tensors: routers{' + LoRA' if wp.lora is not None else ''}); W in "
                  f"{'the whole row' if wp.windows is None else list(wp.windows)}, d_w in {list(wp.pools)}, unconstrained {wp.unconstrained_frac:.0%} of steps, aux coef {self.aux_coef}")
            with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))

    def _apply_lora(self, model: torch.nn.Module) -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model

        lora = self.cfg.window_pool.lora
        if int(lora.r) < 1 or float(lora.alpha) <= 0 or not 0.0 <= float(lora.dropout) < 1.0:
            raise VatError(f"window_pool.lora needs r >= 1, alpha > 0 and 0 <= dropout < 1, got {dict(lora)}")
        config = LoraConfig(r=int(lora.r), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                            target_modules=list(lora.target_modules) or None,
                            target_parameters=list(lora.target_parameters) or None, bias="none")
        try:
            return get_peft_model(model, config)
        except ValueError as err:
            raise VatError(f"window_pool.lora: {str(err).splitlines()[0]}") from None

    def _setup_data(self) -> None:
        cfg = self.cfg
        tokenizer_dir = self.target.path or cfg.target.path
        self.dataset = training_rows(cfg.data.train, cfg.target.path, tokenizer_dir, cfg.data.max_length,
                                     cfg.data.limit)
        self.batches = BucketedBatches(
            lengths=self.dataset.lengths, tokens_per_batch=cfg.data.tokens_per_batch,
            max_batch_size=cfg.data.max_batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle,
            num_replicas=self.accelerator.num_processes, rank=self.accelerator.process_index,
        )
        self.batches_per_epoch = len(self.batches)
        pad = getattr(self.target.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def _setup_optimizer(self) -> None:
        cfg = self.cfg
        self.trainable_params = [p for p in self.model.parameters() if p.requires_grad]  # what is clipped each step
        self.optimizer = torch.optim.AdamW(self.trainable_params, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                           weight_decay=cfg.train.weight_decay)
        steps_per_epoch = max(self.batches_per_epoch // cfg.train.grad_accum, 1)
        self.total_steps = int(cfg.train.max_steps or steps_per_epoch * cfg.train.epochs)
        warmup = int(math.ceil(cfg.train.warmup_ratio * self.total_steps))
        if cfg.train.scheduler == "cosine":
            self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, warmup, self.total_steps)
        else:
            self.scheduler = get_constant_schedule_with_warmup(self.optimizer, warmup)
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)

    # ---- one micro-batch -----------------------------------------------------------------------------------------
    def forward_loss(self, batch: dict[str, torch.Tensor], spec) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and metric sums of one micro-batch under the step's constraint (``spec`` None = natural routing).

        Args:
            batch: ``input_ids``, ``attention_mask``, ``loss_mask`` (B, T).
            spec: a :class:`~vat.target.budget.BudgetSpec` (the pools) or None.

        Returns:
            ``(loss, sums)``: loss = mean LM NLL + aux_coef * load-balancing loss + pool_weight * mean outside mass.
        """
        wp = self.cfg.window_pool
        input_ids, attention = batch["input_ids"], batch["attention_mask"]  # (B, T)
        real = attention.bool()
        batch_size, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(batch_size, -1)  # (B, T)
        groups, n_groups = (None, 0)
        if spec is not None:
            groups, n_groups = window_groups(positions, real, spec)
        with self.routing.forward_context(groups.reshape(-1) if groups is not None else None, n_groups, spec,
                                          capture=False, record_pools=spec is not None) as ctx:
            out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                             output_router_logits=self.aux_coef > 0, use_cache=False)
        valid = real & batch["loss_mask"].bool() if wp.loss_on == "mask" else real
        nll_sum, count = lm_loss_sums(out.logits, input_ids, valid)
        loss = nll_sum / count.clamp_min(1.0)
        aux = getattr(out, "aux_loss", None)
        aux = aux.float() if isinstance(aux, torch.Tensor) else torch.zeros((), device=loss.device)
        loss = loss + self.aux_coef * aux
        sums = {"nll": nll_sum.detach(), "tokens": count.detach(), "aux": aux.detach(), "micro": torch.tensor(1.0)}
        if spec is not None:
            mass = pool_mass(ctx.pools, groups.reshape(-1) >= 0, self.target.top_k)
            if float(wp.pool_weight) > 0:
                loss = loss + float(wp.pool_weight) * mass["outside_sum"] / mass["count"].clamp_min(1.0).to(loss.device)
            sums.update({"nll_pooled": nll_sum.detach(), "tokens_pooled": count.detach(),
                         "outside": mass["outside_sum"].detach().float(), "inside": mass["inside_sum"],
                         "pool_count": mass["count"]})
        ctx.pools.clear()  # drop the references to the graph
        return loss, sums

    # ---- the loop's hooks (vat.train.loop) --------------------------------------------------------------------------
    def trained_module(self) -> torch.nn.Module:
        return self.model

    def step_context(self, step: int):
        return draw_constraint(self.cfg.window_pool, self.cfg.seed, step)  # the step's windows / pools, or None

    def keep_micro_batch(self, loss: torch.Tensor, indices: list[int]) -> bool:
        if not torch.isfinite(loss):
            raise VatError(f"non-finite Window Pool loss at step {self.step + 1} (epoch {self.position.epoch}, "
                           f"batch {self.position.batch_index - 1})")
        return True

    def clip_gradients(self) -> dict[str, torch.Tensor]:
        return {"grad_norm": torch.nn.utils.clip_grad_norm_(self.trainable_params, self.cfg.train.grad_clip)}

    def on_run_start(self) -> None:
        self.cpu_start, self.wall_start = time.process_time(), time.time()

    def writes_record(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.total_steps

    def on_record(self, record: dict, bar) -> None:
        bar.set_postfix(nll=f"{record['lm_loss']:.3f}", W=record["window"], d=record["pool"])

    def step_record(self, sums: dict[str, torch.Tensor], losses: list[torch.Tensor], spec) -> dict:
        """Every step's record (sums reduced across processes); metrics.jsonl gets every ``train.log_every``-th."""
        self.tokens_seen += float(sums["tokens"])
        return self._record(sums, spec, time.time() - self.wall_start, time.process_time() - self.cpu_start)

    def _record(self, sums: dict[str, torch.Tensor], spec, wall: float, cpu: float) -> dict:
        sums = {k: self.accelerator.reduce(torch.as_tensor(v, device=self.device).float(), reduction="sum").cpu()
                for k, v in sorted(sums.items())}
        micro = float(sums["micro"])
        record: dict[str, Any] = {
            "step": self.step,
            "lm_loss": float(sums["nll"] / sums["tokens"].clamp_min(1)),
            "aux_loss": float(sums["aux"]) / micro,
            "constrained": spec is not None,
            "window": spec.window if spec is not None else None,
            "pool": (next(iter(spec.B.values())) if isinstance(spec.B, dict) else spec.B) if spec is not None else None,
            # identical on every rank after the all-reduce of gradients
            "grad_norm": float(sums["grad_norm"]) / self.accelerator.num_processes,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "tokens": float(sums["tokens"]),
            "tokens_seen": self.tokens_seen,
            "epoch": self.position.epoch,
            "wall_seconds": round(wall, 2),
            "cpu_seconds": round(self.cpu_seconds_before + cpu, 2),
        }
        if "pool_count" in sums:
            count = float(sums["pool_count"].clamp_min(1))
            record["outside_mass"] = float(sums["outside"]) / count  # router mass outside the pool
            record["natural_in_pool"] = float(sums["inside"]) / count  # token-layers whose natural top-k fits
        return record

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def _trainable_state(self) -> dict[str, torch.Tensor]:
        model = self.accelerator.unwrap_model(self.model)
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}

    def save_checkpoint(self) -> str | None:
        """Rank 0 writes ``checkpoints/step_N``: trainable weights, optimizer, scheduler, RNG, data position."""
        self.accelerator.wait_for_everyone()
        if not self.is_main:
            return None

        def fill(tmp: str) -> None:
            torch.save({
                "step": self.step, "position": (self.position.epoch, self.position.batch_index), "trainable": self._trainable_state(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(), "tokens_seen": self.tokens_seen,
                "cpu_seconds": self.cpu_seconds_before + time.process_time() - self.cpu_start,
            }, os.path.join(tmp, STATE_FILE))
            with open(os.path.join(tmp, "config.yaml"), "w") as f:
                f.write(to_yaml(self.cfg))

        return write_checkpoint(self.cfg.output_dir, self.step, fill, self.cfg.train.keep_last)

    def load_state(self, directory: str) -> None:
        state = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=False)
        if "trainable" not in state:
            raise VatError(f"{directory} is not a Window Pool checkpoint (no trainable target weights)")
        model = self.accelerator.unwrap_model(self.model)
        params = dict(model.named_parameters())
        if sorted(state["trainable"]) != sorted(self.trainable):
            raise VatError(f"{directory} trained other parameters than this run ({len(state['trainable'])} vs "
                           f"{len(self.trainable)} tensors): resume with the same window_pool.lora / train_routers")
        with torch.no_grad():
            for name, value in state["trainable"].items():
                params[name].copy_(value.to(params[name].device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.position = DataPosition(*state["position"])
        self.tokens_seen = float(state["tokens_seen"])
        self.cpu_seconds_before = float(state.get("cpu_seconds", 0.0))
        if self.is_main:
            print(f"[vat] resumed from {directory} at step {self.step}")

    def save_final(self, last: dict[str, Any]) -> str | None:
        """Write ``output_dir/final``: the target (adapters merged) + its tokenizer + ``window_pool.json``."""
        self.accelerator.wait_for_everyone()
        if not self.is_main:
            return None
        model = self.accelerator.unwrap_model(self.model)
        if self.cfg.window_pool.lora is not None:
            model = model.merge_and_unload()  # the last thing this run does with the model
        final = os.path.join(self.cfg.output_dir, "final")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(self.target.path or self.cfg.target.path).save_pretrained(tmp)
        summary = {
            "base_target": self.target.path or self.cfg.target.path,
            "steps": self.step, "tokens_seen": self.tokens_seen,
            "cpu_seconds": round(self.cpu_seconds_before + time.process_time() - self.cpu_start, 1),
            "trainable": self.trainable, "aux_loss_coef": self.aux_coef, "last": last,
            "window_pool": json.loads(json.dumps(dict(_plain(self.cfg.window_pool)))),
            "data": self.cfg.data.train,
        }
        with open(os.path.join(tmp, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=2)
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(to_yaml(self.cfg))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        print(f"[vat] Window Pool target written to {final}")
        return final

    def close(self) -> None:
        self.target.close()


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else node


def main(cfg: Any) -> dict[str, Any]:
    """Window Pool training: setup -> run -> cleanup. Returns the last logged metrics."""
    trainer = WindowPoolTrainer(cfg)
    trainer.setup()
    try:
        return trainer.run()
    finally:
        trainer.close()
