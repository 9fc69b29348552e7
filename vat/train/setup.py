"""What one draft-training run builds before its first step (:class:`TrainerSetup`, a part of
:class:`vat.train.trainer.Trainer`): accelerate (DDP, or FSDP2 with ``train.fsdp``), the frozen target (or its
captured features, ``data.capture``), the prepared data in length buckets and the draft vocabulary, the draft (new,
or imported with ``train.init_from``; LoRA adapters with ``train.lora``), the losses' switches, the online affinity
table and the union scale, the budget, and the optimizer with its two clipped groups (body, verification head) and
the LR schedule.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from omegaconf import OmegaConf
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from vat.affinity import OnlineAffinity
from vat.config import to_yaml
from vat.data_prep.capture_store import CaptureReader
from vat.errors import VatError
from vat.export.init_from import source_aux_layer_ids
from vat.losses import LossSwitches
from vat.paths import TINY_TARGET_NAMES
from vat.target import BudgetSpec, load_target
from vat.target.captured import load_captured_target
from vat.train.data import BucketedBatches, load_prepared_rows
from vat.train.defaults import TINY_DATA_NAMES, ensure_draft_vocab, resolve_train_data
from vat.train.distributed import fsdp2_plugin
from vat.train.kinds.base import check_vocab_setting
from vat.train.lora import VH_PREFIX, apply_lora
from vat.union_scale import UnionScale


class TrainerSetup:
    """:meth:`setup` and its parts. It sets what the loop (:class:`vat.train.loop.TrainLoop`) and the step read:
    ``accelerator``, ``device``, ``is_main``, ``target``, ``dataset``, ``batches``, ``pad_id``, ``drafter``,
    ``draft_config``, the vocabulary maps, ``switches``, ``K``, ``affinity``, ``union_scale``, ``budget``,
    ``optimizer``, ``scheduler``, ``total_steps``. Reads ``cfg`` and ``kind``, set by the trainer's constructor."""

    def setup(self) -> None:
        cfg = self.cfg
        mixed = cfg.train.mixed_precision
        if mixed == "auto":
            mixed = "bf16" if torch.cuda.is_available() else "no"
        # cpu=True on a CPU-only machine: that is what makes a multi-process launch MULTI_CPU (gloo) instead of N
        # independent single-process runs
        self.accelerator = Accelerator(
            mixed_precision=mixed, gradient_accumulation_steps=cfg.train.grad_accum, cpu=not torch.cuda.is_available(),
            **self._parallel_kwargs(),
        )
        if self.sharded:  # accelerate shards only with several accelerator processes
            self.sharded = self.accelerator.distributed_type == DistributedType.FSDP
            if not self.sharded and self.accelerator.is_main_process:
                print("[vat] train.fsdp: a single process has nothing to shard; training unsharded")
        set_seed(cfg.seed)
        self.device = self.accelerator.device
        self.is_main = self.accelerator.is_main_process
        os.makedirs(cfg.output_dir, exist_ok=True)

        self.target = self._load_target()
        self._setup_data()
        self._setup_drafter()
        if self.capture is not None:  # the layers the draft reads (a DFlash draft picks its own) must be captured
            self.target.aux_columns()
        self._setup_lora()
        self._setup_losses()
        self._setup_optimizer()
        self.budget_rng_seed = cfg.seed * 1_000_003 + 17
        if self.is_main:
            with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))

    def _load_target(self):
        """The frozen target; with ``data.capture`` only its embedding, final norm and LM head, checked against the
        capture in one line (vat/target/captured.py): the features are read from the capture's shards."""
        cfg = self.cfg
        if cfg.data.capture is None:
            return load_target(
                cfg.target.path, dtype=cfg.target.dtype, device=self.device, experts_impl=cfg.target.experts_impl,
                aux_layer_ids=self._aux_layer_ids(), device_map=cfg.target.device_map,
            )
        if cfg.budget.B is not None:
            raise VatError(f"budget.B is set but data.capture {cfg.data.capture} holds the target's natural forward: a "
                           "budgeted target's features exist only online; unset data.capture (or budget.B)")
        self.capture = CaptureReader(cfg.data.capture)
        if not self.capture.has_routing and cfg.loss.union_weight:
            raise VatError(f"loss.union_weight is {cfg.loss.union_weight} but data.capture {cfg.data.capture} holds no "
                           "routing (speculators' hidden states): the union term reads the target's experts; set "
                           "loss.union_weight=0, or capture with `vat prep capture`")
        return load_captured_target(cfg.target.path, self.capture.target, dtype=cfg.target.dtype, device=self.device,
                                    aux_layer_ids=self._aux_layer_ids())

    def _capture_rows(self, rows: list[int]) -> list[int]:
        """The capture's row of each training sample; one line when the capture lacks some."""
        missing = self.capture.missing(rows)
        if missing:
            raise VatError(f"data.capture {self.capture.directory} lacks {len(missing)} of the {len(rows)} rows "
                           f"data.train keeps (first: row {missing[0]}): capture {self.data_path} with --limit / "
                           "--max-length keeping them, or lower data.limit / data.max_length")
        return rows

    def _parallel_kwargs(self) -> dict[str, Any]:
        """DDP by default (accelerate's own choice); ``train.fsdp``: FSDP2 through accelerate's plugin (GPUs only)."""
        self.sharded = bool(self.cfg.train.fsdp)
        if not self.sharded:
            return {}

        return {"fsdp_plugin": fsdp2_plugin(torch.cuda.is_available())}

    def _setup_lora(self) -> None:
        """``train.lora``: peft adapters on the draft's decoder layer; the VH (and fc with train_fc) train in full."""
        self.lora_targets: list[str] = []
        lora = self.cfg.train.lora
        if lora is None:
            return

        if not self.kind.supports_lora:
            raise VatError(f"train.lora supports EAGLE-3 drafts, not drafter.kind `{self.cfg.drafter.kind}`")
        self.lora_targets = apply_lora(self.drafter, lora)
        if self.is_main:
            trainable = sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)
            total = sum(p.numel() for p in self.drafter.parameters())
            print(f"[vat] LoRA r={lora.r} alpha={lora.alpha} on {len(self.lora_targets)} layers: "
                  f"{trainable:,} of {total:,} parameters train (adapters, verification head"
                  f"{', fc' if lora.train_fc else ''})")

    def _aux_layer_ids(self) -> list[int] | None:
        """The target layers to capture: ``target.aux_layer_ids``, else an imported draft's, else EAGLE-3's default."""
        if self.cfg.target.aux_layer_ids is not None:
            return list(self.cfg.target.aux_layer_ids)
        if self.cfg.train.init_from:
            return source_aux_layer_ids(self.cfg.train.init_from)
        return None

    def _setup_data(self) -> None:
        cfg = self.cfg
        data_path = cfg.data.train
        if data_path in TINY_DATA_NAMES:  # the embedded target's data, built once by rank 0, then read by all
            target_name = cfg.target.path if cfg.target.path in TINY_TARGET_NAMES else "tiny"
            if self.is_main:
                resolve_train_data(data_path, target_name, cfg.data.max_length)
            self.accelerator.wait_for_everyone()
            data_path = resolve_train_data(data_path, target_name, cfg.data.max_length)
        self.data_path = data_path
        self.dataset, self.dropped_over_length, rows = load_prepared_rows(data_path, cfg.data.max_length,
                                                                          cfg.data.limit)
        self.capture_rows = self._capture_rows(rows) if self.capture is not None else None
        lengths = self.dataset["length"] if "length" in self.dataset.column_names else [
            len(x) for x in self.dataset["input_ids"]]
        self.batches = BucketedBatches(
            lengths=list(lengths), tokens_per_batch=cfg.data.tokens_per_batch, max_batch_size=cfg.data.max_batch_size,
            seed=cfg.seed, shuffle=cfg.data.shuffle, num_replicas=self.accelerator.num_processes,
            rank=self.accelerator.process_index,
        )
        self.batches_per_epoch = len(self.batches)
        vocab_path = cfg.data.vocab
        check_vocab_setting(self.kind, vocab_path)
        if self.kind.full_vocab:  # predicts over the target's whole vocabulary (its LM head)
            pass
        elif cfg.train.init_from:  # the imported draft brings its own vocabulary
            vocab_path = cfg.train.init_from
        elif vocab_path is None:
            cache = os.path.join(cfg.output_dir, "vocab")
            if self.is_main:
                ensure_draft_vocab(data_path, self.target.vocab_size, cfg.drafter.draft_vocab_size, cache)
            self.accelerator.wait_for_everyone()
            vocab_path = ensure_draft_vocab(data_path, self.target.vocab_size, cfg.drafter.draft_vocab_size, cache)
        self.vocab_path = vocab_path
        tokenizer_pad = getattr(self.target.config, "pad_token_id", None)
        self.pad_id = int(tokenizer_pad) if tokenizer_pad is not None else 0

    def _setup_drafter(self) -> None:
        """A new draft from the recipe, or an imported one (``train.init_from``), with its vocabulary lookups."""
        cfg = self.cfg
        drafter = self._import_drafter() if cfg.train.init_from else self.kind.new(cfg, self.target, self.vocab_path)
        self.draft_config = drafter.config
        self.drafter = drafter.to(self.device)
        if self.kind.full_vocab:  # the target's vocabulary: no draft-vocab map
            self.draft_to_target = None
            self.target_to_draft = torch.arange(self.target.vocab_size, device=self.device)
            return
        d2t = drafter.d2t.cpu()
        # absolute target ids of the draft vocab: used[i] = i + d2t[i]
        self.draft_to_target = (torch.arange(d2t.shape[0]) + d2t).to(self.device)
        self.target_to_draft = torch.full((self.target.vocab_size,), -1, dtype=torch.long)
        self.target_to_draft[self.draft_to_target.cpu()] = torch.arange(d2t.shape[0])
        self.target_to_draft = self.target_to_draft.to(self.device)

    def _import_drafter(self):
        """``train.init_from``: the source's architecture and weights, the recipe's unroll / block and VH."""
        drafter, what = self.kind.import_from(self.cfg, self.target)
        if self.is_main:
            print(f"[vat] init_from {self.cfg.train.init_from}: {what} (drafter.* architecture keys unused)")
        return drafter

    def _setup_losses(self) -> None:
        cfg, target = self.cfg, self.target
        self.switches = LossSwitches.from_config(cfg.loss, kind=self.kind.schedule, block_size=cfg.drafter.block_size)
        self.K = self.kind.num_slots(cfg, self.draft_config)  # draft positions per anchor: TTT steps, block slots
        self.affinity = None
        # the union is simulated (and logged) for every method so runs compare; it is penalised only when λ > 0
        if cfg.loss.affinity is not None:
            self.affinity = OnlineAffinity.from_file(cfg.loss.affinity, top_k=target.top_k, ema=cfg.loss.affinity_ema)
            if self.affinity.num_rows != self.draft_config.draft_vocab_size:
                raise VatError(
                    f"affinity table {cfg.loss.affinity} has {self.affinity.num_rows} rows but the draft vocab has "
                    f"{self.draft_config.draft_vocab_size}: build it with `vat prep affinity --vocab VOCAB`"
                )
        else:
            self.affinity = OnlineAffinity(
                self.draft_config.draft_vocab_size, len(target.moe_layer_ids), target.num_experts, target.top_k,
                ema=cfg.loss.affinity_ema, storage=cfg.loss.affinity_storage,
                layer_stride=int(cfg.loss.affinity_layer_stride),
            )
        self.affinity = self.affinity.to(self.device)
        # λ's scale s: 0 until the table has folded routing (a loaded table has), measured over a warm-up of steps, then
        # frozen (vat.union_scale)
        self.union_scale = UnionScale(warmup=int(cfg.loss.union_scale_warmup), bound=self.switches.union_scale_max)
        self.union_scale.informative = cfg.loss.affinity is not None
        self.union_bound_reported = False
        self.budget = None
        if cfg.budget.B is not None:
            b = OmegaConf.to_container(cfg.budget, resolve=True)["B"]  # int, list or {layer: B}
            self.budget_window = int(cfg.budget.window or self.K + 1)
            self.budget = BudgetSpec(B=b, policy=cfg.budget.policy, window=self.budget_window, scope=cfg.budget.scope)

    def _setup_optimizer(self) -> None:
        cfg = self.cfg
        # the verification head is its own parameter group with its own clip: its gradient must not set the clip
        # factor of the draft body (docs/vat_losses.md)
        named = [(n, p) for n, p in self.drafter.named_parameters() if p.requires_grad]
        self.body_params = [p for n, p in named if not n.startswith(VH_PREFIX)]
        self.vh_params = [p for n, p in named if n.startswith(VH_PREFIX)]
        groups = [{"params": self.body_params, "name": "body"}]
        if self.vh_params:
            groups.append({"params": self.vh_params, "name": "verification_head"})
        self.optimizer = torch.optim.AdamW(
            groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay
        )
        steps_per_epoch = max(self.batches_per_epoch // cfg.train.grad_accum, 1)
        self.total_steps = int(cfg.train.max_steps or steps_per_epoch * cfg.train.epochs)
        warmup = int(math.ceil(cfg.train.warmup_ratio * self.total_steps))
        if cfg.train.scheduler == "cosine":
            scheduler = get_cosine_schedule_with_warmup(self.optimizer, warmup, self.total_steps)
        elif cfg.train.scheduler == "constant":
            scheduler = get_constant_schedule_with_warmup(self.optimizer, warmup)
        else:
            raise VatError(f"unknown train.scheduler `{cfg.train.scheduler}`: one of cosine, constant")
        # the scheduler is NOT prepared: accelerate's AcceleratedScheduler steps it num_processes times per optimizer
        # step (it assumes per-process batches grow the epoch), while total_steps counts optimizer steps; it is
        # stepped once per optimizer step in step_scheduler (vat.train.loop), so every world size runs the same schedule
        self.drafter, self.optimizer = self.accelerator.prepare(self.drafter, self.optimizer)
        self.scheduler = scheduler
        # FSDP2 replaces the parameters by sharded ones (and remaps the optimizer): clip what the optimizer steps
        self.body_params = list(self.optimizer.param_groups[0]["params"])
        self.vh_params = list(self.optimizer.param_groups[1]["params"]) if self.vh_params else []
