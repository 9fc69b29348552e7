"""scripts/evidence_summary.py: the goal verdicts on hand-built bench summaries (a win needs both lower bounds above
1; at T = 1 the goal is a VAT recipe at least level with EAGLE-3, both upper bounds reaching 1)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "evidence_summary.py")


@pytest.fixture(scope="module")
def summary_module():
    spec = importlib.util.spec_from_file_location("evidence_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _est(value, low, high, t_low, t_high):
    return {"value": value, "low": low, "high": high, "t": {"low": t_low, "high": t_high},
            "per_seed": {"0": value, "1": value}}


def _summary(temperature, vat_ratio, vat_vs_hard=None):
    stats = lambda ratio, versus=None: {"tau": {"value": 1.5, "low": 1.4, "high": 1.6}, "seeds": [0, 1],  # noqa: E731
                                        "ratio": ratio, "versus": versus or {}}
    return {"name": "b", "reference": "eagle3", "compare": ["eagle3_hard"], "benchmarks": ["humaneval@test"],
            "progress": {"cells_done": 4, "cells_total": 4}, "best_free": {},
            "settings": {"eval": {"temperature": temperature}},
            "results": {"eagle3": {"none": {"humaneval@test": stats(None)}},
                        "eagle3_hard": {"none": {"humaneval@test": stats(_est(1.01, 1.0, 1.02, 1.0, 1.02))}},
                        "vat": {"none": {"humaneval@test": stats(vat_ratio, {"eagle3_hard": vat_vs_hard})}}}}


def test_greedy_goals_need_the_ratio_and_both_lower_bounds(summary_module):
    lines = summary_module.goal_lines(_summary(0.0, _est(1.12, 1.05, 1.2, 1.01, 1.23), _est(1.06, 1.02, 1.1, 0.99, 1.12)))
    assert lines[0].endswith("vat >= 1.10x eagle3: met")
    assert "not met (1.060; an interval reaches 1)" in lines[1]  # the t interval's lower bound is below 1


def test_t1_goal_is_level_with_eagle3(summary_module, tmp_path, capsys):
    level = summary_module.goal_lines(_summary(1.0, _est(0.98, 0.95, 1.01, 0.96, 1.0)))
    assert level == ["- humaneval@test: vat at least level with eagle3 at T = 1: met (0.980 [0.950, 1.010], "
                     "t [0.960, 1.000])"]
    behind = summary_module.goal_lines(_summary(1.0, _est(0.96, 0.94, 0.99, 0.93, 1.01)))
    assert "not met" in behind[0]  # the bootstrap interval stays below 1
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_summary(1.0, _est(0.98, 0.95, 1.01, 0.96, 1.0))))
    assert summary_module.main([str(path)]) == 0
    assert "at least level with eagle3" in capsys.readouterr().out
