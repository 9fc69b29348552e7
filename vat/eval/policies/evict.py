"""EVICT as a registered policy (``--tree-policy evict``): each trained draft's chain, DFlash block or tree cut before
verification (:class:`vat.eval.evict.Evict`, lossless), priced on a cost model against a verification-cost profile
read from ``--verify-cost`` or built on the fly per benchmark and draft, with each draft's acceptance estimates
calibrated per benchmark (:mod:`vat.eval.calibration`). Both on-the-fly fits come from one calibration pass per draft
over prompts the evaluation does not score (the dev split of a ``@test`` benchmark; a benchmark without a split is
fitted on its own first prompts, and says so): its blocks verified uncut give the acceptance calibration and the
draft's own verification-cost profile (:class:`vat.eval.verify_cost.DraftedUnionRecorder`). Without a calibration
pass (``--evict-calibration 0``) the profile comes from the target's own greedy text."""

from __future__ import annotations

import os

import torch

from vat.errors import VatError
from vat.eval.benchmarks import load_benchmark
from vat.eval.calibration import AcceptanceCalibration, CalibrationRecorder
from vat.eval.cost import CostModel, draft_shape, get_accelerator, served_bytes_of, target_shape
from vat.eval.evict import Evict, chain_probs, tree_probs
from vat.eval.policies import EvalPolicy, PolicySetup, RoundPolicy
from vat.eval.prompts import render_chat
from vat.eval.verify_cost import (
    DEFAULT_WIDTHS,
    DraftedUnionRecorder,
    build_verify_cost,
    load_verify_cost,
    own_texts,
)

PROFILE_PROMPTS = 8  # prompts EVICT profiles the verification cost on without --verify-cost
CALIBRATION_PROMPTS = 8  # prompts of the calibration pass without --evict-calibration
DEFAULT_ACCELERATOR = "h200"  # EVICT's cost model without --cost-model


def held_out_prompts(prompts: list, spec: str) -> tuple[list, str]:
    """The prompts EVICT fits on for the benchmark ``spec`` whose scored prompts are ``prompts``: its dev split when
    ``spec`` names the test split (``...@test``), else the scored prompts themselves. Returns (prompts, what they
    are)."""
    if spec.endswith("@test"):
        dev = spec[: -len("@test")] + "@dev"
        return load_benchmark(dev), dev
    return list(prompts), f"{spec} (no dev split: the scored prompts)"


class EvictPolicy(EvalPolicy):
    """EVICT: one :class:`Evict` per pass of a trained draft (its shape prices T_draft; a fixed B caps the union; its
    calibration for the current benchmark maps the raw estimates)."""

    name = "evict"
    summary = ("EVICT: truncate the chain, block or tree to the prefix with the most expected accepted tokens per "
               "modeled verification cost (lossless)")
    settings = {"verify_cost": "EVICT's profile", "evict_calibration": "EVICT's calibration"}
    run_keys = ("evict_profile",)

    def __init__(self, cfg, tree) -> None:
        super().__init__(cfg, tree)
        if cfg.verify_cost is not None and not os.path.exists(cfg.verify_cost):
            raise VatError(f"--verify-cost {cfg.verify_cost}: no such file (write it with `vat profile "
                           "--verify-widths ...`)")
        if cfg.evict_calibration is not None and cfg.evict_calibration < 0:
            raise VatError(f"--evict-calibration must be >= 0 prompts, got {cfg.evict_calibration}")
        self.ctx: PolicySetup | None = None
        self.cost: CostModel | None = None
        self.fixed_table = None  # the --verify-cost profile
        self.table = None  # the VerifyCostTable of the current benchmark (--verify-cost's, or of the target's text)
        self.drafted: dict[str, object] = {}  # draft label -> the current benchmark's profile of its own blocks
        self.calibration: dict[str, AcceptanceCalibration] = {}  # draft label -> the current benchmark's
        self.records: dict[str, dict] = {}  # benchmark -> its profile and calibrations (eval.json)

    @property
    def calibration_prompts(self) -> int:
        """Prompts of the calibration pass (0 = none)."""
        return CALIBRATION_PROMPTS if self.cfg.evict_calibration is None else int(self.cfg.evict_calibration)

    def setup(self, ctx: PolicySetup) -> None:
        """The cost model (``--cost-model``'s, else h200) and the ``--verify-cost`` profile when given."""
        self.ctx = ctx
        self.cost = ctx.cost or CostModel(get_accelerator(DEFAULT_ACCELERATOR), target_shape(ctx.target),
                                          served_bytes_of(self.cfg.served_dtype))
        if self.cfg.verify_cost:
            self.fixed_table = load_verify_cost(self.cfg.verify_cost, len(ctx.target.moe_layer_ids))

    def start_benchmark(self, prompts: list, spec: str) -> None:
        """Per benchmark, on its held-out prompts (:func:`held_out_prompts`): each trained draft's calibration pass,
        which also profiles the verification cost of its own blocks (without ``--verify-cost``); the target's own
        greedy answers give the profile when there is no calibration pass."""
        ctx = self.ctx
        held, source = held_out_prompts(prompts, spec)
        first_turns = [render_chat(ctx.tok, [{"role": "user", "content": p.turns[0]}]) for p in held]
        first_turns = [ids for ids in first_turns if self._fits(ids)]
        self.calibration, self.drafted = {}, {}
        n = self.calibration_prompts
        trained = [d for d in ctx.drafts if not d.is_free] if n and ctx.engine is not None else []
        for draft in trained:
            self.calibration[draft.label], drafted = self._calibrate(draft, first_turns[:n], source)
            if self.fixed_table is None and drafted is not None:
                self.drafted[draft.label] = drafted
        self.table = self.fixed_table
        if self.table is None and (not trained or len(self.drafted) < len(trained)):  # a draft without its own
            ids = first_turns[:PROFILE_PROMPTS]
            widths = sorted({w for w in DEFAULT_WIDTHS if w < ctx.block} | {ctx.block})
            self.table = build_verify_cost(ctx.target, own_texts(ctx.target, ids, ctx.max_new_tokens), widths,
                                           cost=self.cost, measure=False,
                                           source=f"on the fly: the target's greedy answers to {len(ids)} prompts "
                                                  f"of {source}")
        self.records[spec] = {"verify_cost": None if self.table is None else self.table.to_dict(),
                              "verify_cost_drafted": {k: t.to_dict() for k, t in self.drafted.items()},
                              "calibration": {k: c.to_dict() for k, c in self.calibration.items()}}

    def _fits(self, ids: list[int]) -> bool:
        limit = getattr(self.ctx.target.config, "max_position_embeddings", None)
        return limit is None or len(ids) + self.ctx.max_new_tokens + self.ctx.block <= limit

    def _calibrate(self, draft, prompts_ids: list[list[int]], source: str):
        """The draft decodes ``prompts_ids`` (first turns) with its drafts verified uncut: every node is counted for
        the calibration, every block's union for the draft's own verification-cost profile (None without blocks)."""
        what = f"{len(prompts_ids)} prompts of {source}"
        calibration = AcceptanceCalibration(source=what)
        unions = DraftedUnionRecorder(self.ctx.target.num_experts)
        engine = self.ctx.engine(draft, [CalibrationRecorder(calibration, tree_probs, chain_probs), unions])
        for i, ids in enumerate(prompts_ids):
            gen = torch.Generator(device=self.ctx.target.device).manual_seed(i) if self.cfg.temperature > 0 else None
            engine.generate(ids, gen)
        return calibration, unions.table(self.cost, source=f"on the fly: {draft.label}'s own blocks over {what}")

    def for_pass(self, draft, budget) -> RoundPolicy | None:
        """An :class:`Evict` for a trained draft (n-gram chains carry no probabilities: left alone)."""
        if draft.model is None or draft.is_free:
            return None
        cap = budget if isinstance(budget, int) else None  # a fixed B caps the verified union
        return Evict(self.cost, self.drafted.get(draft.label, self.table), draft_shape(draft.model), budget=cap,
                     calibration=self.calibration.get(draft.label))

    def run_record(self) -> dict:
        """``evict_profile``: per benchmark, the verification-cost profiles (``verify_cost``: ``--verify-cost``'s or of
        the target's text, None when every draft has its own; ``verify_cost_drafted``: each draft's own blocks) and
        each draft's calibration."""
        return {"evict_profile": self.records or None}
