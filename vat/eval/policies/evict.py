"""EVICT as a registered policy (``--tree-policy evict``): each trained draft's chain, DFlash block or tree cut before
verification (:class:`vat.eval.evict.Evict`, lossless), priced on a cost model against a verification-cost profile
read from ``--verify-cost`` or built on the fly from the first benchmark's first prompts."""

from __future__ import annotations

import os

from vat.errors import VatError
from vat.eval.cost import CostModel, draft_shape, get_accelerator, served_bytes_of, target_shape
from vat.eval.evict import Evict
from vat.eval.policies import EvalPolicy, PolicySetup, RoundPolicy
from vat.eval.prompts import render_chat
from vat.eval.verify_cost import DEFAULT_WIDTHS, build_verify_cost, load_verify_cost, own_texts

PROFILE_PROMPTS = 8  # prompts EVICT profiles on the fly without --verify-cost
DEFAULT_ACCELERATOR = "h200"  # EVICT's cost model without --cost-model


class EvictPolicy(EvalPolicy):
    """EVICT: one :class:`Evict` per pass of a trained draft (its shape prices T_draft; a fixed B caps the union)."""

    name = "evict"
    summary = ("EVICT: truncate the chain, block or tree to the prefix with the most expected accepted tokens per "
               "modeled verification cost (lossless)")
    settings = {"verify_cost": "EVICT's profile"}
    run_keys = ("evict_profile",)

    def __init__(self, cfg, tree) -> None:
        super().__init__(cfg, tree)
        if cfg.verify_cost is not None and not os.path.exists(cfg.verify_cost):
            raise VatError(f"--verify-cost {cfg.verify_cost}: no such file (write it with `vat profile "
                           "--verify-widths ...`)")
        self.ctx: PolicySetup | None = None
        self.cost: CostModel | None = None
        self.table = None  # the VerifyCostTable; None until read or profiled

    def setup(self, ctx: PolicySetup) -> None:
        """The cost model (``--cost-model``'s, else h200) and the ``--verify-cost`` profile when given."""
        self.ctx = ctx
        self.cost = ctx.cost or CostModel(get_accelerator(DEFAULT_ACCELERATOR), target_shape(ctx.target),
                                          served_bytes_of(self.cfg.served_dtype))
        if self.cfg.verify_cost:
            self.table = load_verify_cost(self.cfg.verify_cost, len(ctx.target.moe_layer_ids))

    def start_benchmark(self, prompts: list) -> None:
        """Without ``--verify-cost``: the profile from the target's own greedy answers to the first benchmark's first
        prompts (first turns)."""
        if self.table is not None:
            return
        ctx = self.ctx
        ids = [render_chat(ctx.tok, [{"role": "user", "content": p.turns[0]}]) for p in prompts[:PROFILE_PROMPTS]]
        widths = sorted({w for w in DEFAULT_WIDTHS if w < ctx.block} | {ctx.block})
        texts = own_texts(ctx.target, ids, ctx.max_new_tokens)
        self.table = build_verify_cost(ctx.target, texts, widths, cost=self.cost, measure=False,
                                       source=f"on the fly: the target's greedy answers to {len(ids)} prompts")

    def for_pass(self, draft, budget) -> RoundPolicy | None:
        """An :class:`Evict` for a trained draft (n-gram chains carry no probabilities: left alone)."""
        if draft.model is None or draft.is_free:
            return None
        cap = budget if isinstance(budget, int) else None  # a fixed B caps the verified union
        return Evict(self.cost, self.table, draft_shape(draft.model), budget=cap)

    def run_record(self) -> dict:
        """``evict_profile``: the verification-cost profile it ran with."""
        return {"evict_profile": None if self.table is None else self.table.to_dict()}
