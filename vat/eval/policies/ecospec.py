"""EcoSpec as a registered policy (``--tree-policy ecospec``): each trained EAGLE-3 draft's tree nodes chosen by draft
log-probability minus λ x predicted new experts per layer (:class:`vat.eval.ecospec.EcoSpec`, lossless), the expert
predictor from ``--affinity`` or the draft's own ``affinity.safetensors``."""

from __future__ import annotations

import os

from vat.errors import VatError
from vat.eval.ecospec import AFFINITY_FILE, EcoSpec, ExpertPredictor
from vat.eval.policies import EvalPolicy, PolicySetup, RoundPolicy


class EcoSpecPolicy(EvalPolicy):
    """EcoSpec: one :class:`EcoSpec` per trained tree draft, loaded before anything decodes."""

    name = "ecospec"
    summary = ("EcoSpec: tree nodes chosen by draft log-probability minus --ecospec-lambda x predicted new experts "
               "per layer (lossless; needs --tree)")
    settings = {"ecospec_lambda": None, "affinity": "EcoSpec's expert predictor"}

    def __init__(self, cfg, tree) -> None:
        super().__init__(cfg, tree)
        if tree is None:
            raise VatError("--tree-policy ecospec chooses the nodes of a dynamic tree: add --tree top_k,depth,total")
        if cfg.affinity is not None and not os.path.exists(cfg.affinity):
            raise VatError(f"--affinity {cfg.affinity}: no such file (write one with `vat prep affinity`)")
        self.by_label: dict[str, EcoSpec] = {}

    def setup(self, ctx: PolicySetup) -> None:
        """Each EAGLE-3 draft's expert predictor (a DFlash draft drafts blocks, not trees)."""
        for d in ctx.drafts:
            if d.is_block:
                continue
            source = self.cfg.affinity or d.path
            if source is None or (self.cfg.affinity is None and not os.path.exists(os.path.join(source,
                                                                                                  AFFINITY_FILE))):
                raise VatError(f"--tree-policy ecospec: draft {d.label} has no {AFFINITY_FILE}; give the expert "
                               "predictor with --affinity FILE (`vat prep affinity` output)")
            t2d = getattr(d.model, "t2d", None)
            predictor = ExpertPredictor.load(source, ctx.target.vocab_size, t2d)
            self.by_label[d.label] = EcoSpec(predictor, lam=self.cfg.ecospec_lambda)

    def for_pass(self, draft, budget) -> RoundPolicy | None:
        """The draft's :class:`EcoSpec` (None for the AR pass, free and block drafts)."""
        return self.by_label.get(draft.label) if draft.model is not None else None

    def draft_record(self, draft) -> dict:
        """``ecospec_affinity``: where the draft's expert predictor came from."""
        spec = self.by_label.get(draft.label)
        return {} if spec is None else {"ecospec_affinity": spec.predictor.source}
