"""The demo's stage ETA: scaled by the pace of stages that did real work, blind to stages served from the cache."""

from __future__ import annotations

import time

from vat.demo import Stages, plan_for


def test_pace_ignores_cached_stages_and_scales_by_real_ones(capsys):
    stages = Stages(["target", "data", "train"], [100.0, 10.0, 10.0])
    assert stages.pace(0.0) == 1.0  # nothing finished, a probe at the reference pace: the expected times as they are
    stages.marks = [0.0, 1.0]  # target served from the cache in 1 s of 100: says nothing about the machine
    assert stages.pace(21.0) == 2.0  # data took 20 s of an expected 10
    stages.index = 2
    now = time.time()
    stages.marks = [now - 21.0, now - 20.0]
    stages.next()
    line = capsys.readouterr().out.strip()
    assert line.startswith("[vat demo 3/3] train") and "about 0.3 min left" in line  # 2.0 x 10 s


def test_plans_are_the_same_pipeline_smaller():
    quick, full, full_dflash = plan_for(True), plan_for(False), plan_for(False, dflash=True)
    assert quick.drafts == full_dflash.drafts and quick.budgets == full.budgets == [None, 6, 4]
    assert set(full.drafts) == {"eagle3", "eagle3+vat"}  # the full demo adds DFlash + VAT only when asked (--dflash)
    assert set(quick.drafts) == {"eagle3", "eagle3+vat", "dflash+vat"}
    assert full_dflash.seconds["eval"] > full.seconds["eval"]
    assert quick.train_steps < full.train_steps and quick.eval_limit < full.eval_limit
    # both on the quick target (its build is ~1.5 min, the full one's 11.5-24 min), the full demo on more of its answers
    assert quick.target == full.target == "tiny-quick" and quick.regen_conversations < full.regen_conversations
    assert set(quick.seconds) == set(full.seconds) == {"target", "data", "train", "eval"}


def test_first_estimate_uses_the_probe_pace_until_a_stage_did_real_work(capsys):
    stages = Stages(["target", "data", "train"], [100.0, 10.0, 10.0], probe_pace=2.5)
    assert stages.pace(0.0) == 2.5  # nothing finished: the probe's pace
    stages.marks = [0.0, 1.0]  # the target from the cache: still the probe's
    assert stages.pace(1.5) == 2.5
    assert stages.pace(11.0) == 2.5  # data at the reference pace: partly cached, the probe says the machine is slow
    assert stages.pace(31.0) == 3.0  # data 3x its expected time: the machine got busier than the probe saw
    stages.marks, stages.start = [], time.time()
    stages.next()
    assert "about 5.0 min left" in capsys.readouterr().out  # 2.5 x 120 s

