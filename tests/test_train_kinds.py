"""The drafter-kind registry: the trainer builds, feeds and checks a draft only through its kind, so a kind added in
its own module with one registry line trains; an unknown kind stops in one line before anything loads."""

from __future__ import annotations

import pytest
import torch
from helpers import read_metrics, train_config

from vat.errors import VatError
from vat.train import kinds
from vat.train.kinds.eagle3 import Eagle3Kind
from vat.train.trainer import Trainer
from vat.train.trainer import main as train_main


class OneStepKind(Eagle3Kind):
    """A toy kind: an EAGLE-3 head that drafts one token per anchor whatever ``drafter.ttt_steps`` says."""

    name, title = "one_step", "one-step EAGLE-3"
    calls = 0

    def num_slots(self, cfg, draft_config) -> int:
        return 1

    def training_slots(self, drafter, draft_config, cfg, batch, tout, dist, num_experts, anchor_seed, autocast):
        OneStepKind.calls += 1
        return super().training_slots(drafter, draft_config, cfg, batch, tout, dist, num_experts, anchor_seed, autocast)


def test_unknown_kind_stops_with_the_closest_before_loading(train_workspace, tmp_path):
    cfg = train_config(train_workspace, str(tmp_path / "run"), "drafter.kind=eagel3")
    with pytest.raises(VatError, match=r"drafter.kind.*eagel3.*did you mean `eagle3`"):
        Trainer(cfg)  # the constructor loads nothing


def test_a_kind_registered_in_one_line_trains(train_workspace, tmp_path, monkeypatch):
    monkeypatch.setitem(kinds.DRAFTER_KINDS, "one_step", f"{__name__}:OneStepKind")
    out = str(tmp_path / "run")
    cfg = train_config(train_workspace, out, "drafter.kind=one_step", "drafter.ttt_steps=4", "train.max_steps=2")
    OneStepKind.calls = 0
    trainer = Trainer(cfg)
    assert isinstance(trainer.kind, OneStepKind)
    train_main(cfg)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and OneStepKind.calls >= 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert "acc_0" in rows[-1] and "acc_1" not in rows[-1]  # one slot per anchor, not ttt_steps = 4
