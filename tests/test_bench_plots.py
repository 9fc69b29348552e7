"""The bench's Pareto plot (τ against expert MiB per generated token) on a small bench.json fixture."""

from __future__ import annotations

import json
import os

import pytest

from vat.bench.plots import pareto_points, plot_pareto_bytes, write_plots

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bench_small.json")


def _summary() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def test_pareto_points_are_every_method_x_budget_with_bytes_and_quality_beside_budgeted_ones():
    summary = _summary()
    summary["results"]["vat"]["4"]["spec_bench"]["quality"]["stepwise_agreement"] = 0.93
    points = pareto_points(summary, "spec_bench")
    keys = {(p["label"], p["budget"]) for p in points}
    # eagle3 and vat at natural routing and B = 8, 4; vat_union0.1 natural only; AR; ngram has no bytes in the fixture
    assert keys == {("eagle3", "none"), ("eagle3", "8"), ("eagle3", "4"), ("vat", "none"), ("vat", "8"),
                    ("vat", "4"), ("vat_union0.1", "none"), ("none", "none")}
    vat4 = next(p for p in points if p["label"] == "vat" and p["budget"] == "4")
    stats = summary["results"]["vat"]["4"]["spec_bench"]
    assert vat4["mib"] == stats["expert_mib_per_token"]["value"] and vat4["tau"] == stats["tau"]["value"]
    assert vat4["agreement"] == stats["quality"]["agreement"] and vat4["stepwise_agreement"] == 0.93
    vat8 = next(p for p in points if p["label"] == "vat" and p["budget"] == "8")
    assert vat8["stepwise_agreement"] is None  # the fixture's older quality figures have none
    assert all(p["agreement"] is None for p in points if p["budget"] == "none")
    assert next(p for p in points if p["label"] == "eagle3" and p["budget"] == "8")["agreement"] is None  # no quality


def test_pareto_plot_writes_a_png_per_bench_json_and_nothing_without_bytes(tmp_path):
    summary = _summary()
    path = plot_pareto_bytes(summary, str(tmp_path / "pareto.png"))
    assert path and os.path.getsize(path) > 10_000
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    written = write_plots(summary, str(tmp_path))
    assert str(tmp_path / "pareto_mib.png") in written
    for label in summary["results"].values():  # an older bench.json: no expert bytes anywhere
        for budget in label.values():
            for stats in budget.values():
                stats.pop("expert_mib_per_token", None)
    assert plot_pareto_bytes(summary, str(tmp_path / "none.png")) is None
    assert not os.path.exists(tmp_path / "none.png")


def test_every_budgeted_row_of_the_bench_tables_has_its_quality_cells():
    """bench.md: each τ under a budget sits beside its agreement and KL, or says the quality was not measured (an
    eval without quality figures), and every row has as many cells as its table's header."""
    from vat.bench.summary import markdown

    summary = _summary()
    summary["settings"] = {"eval": {"limit": 12, "max_new_tokens": 64, "steps": 7, "temperature": 0.0}}
    text = markdown(summary)
    tables = [block for block in text.split("## ")[1:] if "|" in block]
    assert len(tables) == 6  # 2 benchmarks x (natural, B = 8, B = 4)
    for block in tables:
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert all(row.count("|") == rows[0].count("|") for row in rows), block
        if "expert budget" in block.splitlines()[0]:
            assert "agreement | stepwise agreement | KL to natural" in rows[0]
            cells = {row.split("|")[1].strip(): row.split("|")[3].strip() for row in rows[2:]}
            assert cells["vat"] in ("97.0 %", "87.0 %")
            assert cells["eagle3"].startswith("not measured")  # the fixture's eagle3 has no quality figures


def test_eval_pareto_on_expert_mib_per_token(tmp_path):
    """vat eval's mib_vs_tau.png: τ against expert MiB per generated token through each draft's budgets; nothing
    without expert bytes (an older eval.json)."""
    from vat.eval.plots import plot_mib_vs_tau

    quality = {"agreement": 0.96, "kl_to_natural": 0.02}
    result = {"pooled": {
        "vat": {"none": {"tau": 3.3, "expert_bytes_per_token": 7.4e6},
                "8": {"tau": 3.0, "expert_bytes_per_token": 5.1e6, "quality": quality},
                "4": {"tau": 2.4, "expert_bytes_per_token": 3.0e6, "quality": quality}},
        "none": {"none": {"tau": 1.0, "expert_bytes_per_token": 7.1e6}},
    }}
    path = plot_mib_vs_tau(result, str(tmp_path / "mib.png"))
    assert path and os.path.getsize(path) > 10_000
    for per_budget in result["pooled"].values():
        for entry in per_budget.values():
            entry.pop("expert_bytes_per_token")
    assert plot_mib_vs_tau(result, str(tmp_path / "none.png")) is None


def test_a_method_label_with_a_dot_is_refused_in_one_line(tmp_path):
    """`vat_union0.1` would split `methods.vat_union0.1.recipe` into other config keys (it crashed the key check):
    one clear line instead, in the YAML and in an override; the packaged union bench's labels load."""
    import pytest

    from vat.bench.config import load_bench_config
    from vat.errors import VatError

    config = tmp_path / "bench.yaml"
    config.write_text("methods:\n  vat_union0.1:\n    recipe: tiny/eagle3_vat.yaml\nreference: vat_union0.1\n")
    with pytest.raises(VatError, match="method label `vat_union0.1` must be letters, digits and _ \\+ -"):
        load_bench_config(str(config))
    config.write_text("methods:\n  vat:\n    recipe: tiny/eagle3_vat.yaml\nreference: vat\n")
    with pytest.raises(VatError):
        load_bench_config(str(config), ["methods.vat_u0.1.recipe=tiny/eagle3_vat.yaml"])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench = load_bench_config(os.path.join(repo, "recipes", "bench", "tiny_union.yaml"))
    assert {"vat_union_0p1", "vat_union_0p4", "vat_union_1p6"} <= set(bench.methods)


def test_front_ratios_flags_and_goal_score_by_hand():
    """Each method x budget against the reference's natural routing: τ and MiB ratios are ratios of pooled sums
    (paired by seed, a baseline over prompts), the front drops dominated points, the goal score is the largest
    normalised shortfall (natural routing counts as 100 % agreement), and bench.md lists them with the closest."""
    import numpy as np
    from omegaconf import OmegaConf

    from vat.bench.summary import MIB, _front_lines, front_statistics
    from vat.eval.quality import empty_counts

    def entry(seeds, committed, rounds, mib, kept, quality=None, greedy=True):
        a = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
        return {"seeds": seeds, "ids": [1, 2], "committed": a(committed), "rounds": a(rounds),
                "expert_bytes": a(mib) * MIB, "kept": a(kept), "quality": quality, "greedy": greedy}

    q = {"counts": {**empty_counts(), "matches": 96, "compared": 100, "kl_sum": 0.5, "kl_count": 100, "turns": 4,
                    "step_matches": 99, "step_compared": 100, "step_turns": 4}, "cells": 2}
    rows = {
        ("eagle3", "none", "b"): entry([0, 1], [[40, 20], [30, 30]], [[10, 10], [10, 10]], [[100, 60], [80, 80]],
                                       [[40, 20], [30, 30]]),
        # τ 3.0 / 3.0 = 1.0, MiB (30 + 30 + 25 + 25) / 120 vs 320 / 120: 0.34375, agreement 96 %: goal met
        ("vat", "4", "b"): entry([0, 1], [[36, 24], [30, 30]], [[10, 10], [10, 10]], [[30, 30], [25, 25]],
                                 [[36, 24], [30, 30]], q),
        # natural: τ 3.3 / 3.0 = 1.1, MiB 330 / 132 = 2.5 / (320 / 120) = 0.9375
        ("vat", "none", "b"): entry([0, 1], [[44, 22], [33, 33]], [[10, 10], [10, 10]], [[110, 55], [82.5, 82.5]],
                                    [[44, 22], [33, 33]]),
        # a baseline (one row, no seed): τ 2.0, MiB 4 per token: dominated by everything
        ("ngram", "none", "b"): entry([None], [[20, 20]], [[10, 10]], [[80, 80]], [[20, 20]]),
    }
    boot = OmegaConf.create({"samples": 300, "seed": 0, "confidence": 0.95})
    points = {(p["label"], p["budget"]): p for p in front_statistics(rows, ["eagle3", "vat", "ngram"], "eagle3",
                                                                       boot)["b"]}
    assert set(points) == {("eagle3", "none"), ("vat", "4"), ("vat", "none"), ("ngram", "none")}
    vat4, vat, ngram, ref = points[("vat", "4")], points[("vat", "none")], points[("ngram", "none")], points[
        ("eagle3", "none")]
    assert vat4["tau_ratio"]["value"] == pytest.approx(1.0) and vat4["mib_ratio"]["value"] == pytest.approx(0.34375)
    assert vat4["mib_per_token"] == pytest.approx(110 / 120) and vat4["agreement"] == pytest.approx(0.96)
    assert vat4["kl_to_natural"] == pytest.approx(0.005) and vat4["stepwise_agreement"] == pytest.approx(0.99)
    assert vat4["goal_score"] == pytest.approx(max(0.34375 / 0.70, 0.98 / 1.0, 0.95 / 0.96))
    assert vat["tau_ratio"]["value"] == pytest.approx(1.1) and vat["mib_ratio"]["value"] == pytest.approx(0.9375)
    assert vat["agreement"] == vat["stepwise_agreement"] == 1.0 and vat["goal_score"] == pytest.approx(0.9375 / 0.70)
    assert ngram["tau_ratio"]["value"] == pytest.approx(2 / 3) and ngram["seeds"] == [0, 1]
    assert ref["tau_ratio"]["value"] == 1.0 and ref["mib_ratio"]["low"] == ref["mib_ratio"]["high"] == 1.0
    for p in points.values():
        for key in ("tau_ratio", "mib_ratio"):
            assert p[key]["low"] <= p[key]["value"] <= p[key]["high"]
    assert {k for k, p in points.items() if p["front"]} == {("vat", "4"), ("vat", "none")}
    results = {"vat": {"4": {"b": {"modeled_speedup": {"value": 1.234, "low": 1.1, "high": 1.3}}}}}
    lines = _front_lines({"front": {"b": list(points.values())}, "reference": "eagle3", "benchmarks": ["b"],
                          "results": results}, 95)
    # lossless (natural routing) and lossy (budgeted) points in two tables, each with its own columns
    lossless = lines[lines.index("Lossless: natural routing, the target's own output distribution:") + 2:]
    lossless = lossless[: lossless.index("")]
    lossy = lines[next(i for i, line in enumerate(lines) if line.startswith("Lossy:")) + 2:]
    lossy = lossy[: lossy.index("")]
    assert len(lossless) == 5 and len(lossy) == 3
    assert all(row.split(" | ")[1] == "none" for row in lossless[2:]) and lossy[2].startswith("| vat | 4 |")
    for table in (lossless, lossy):
        assert all(line.count("|") == table[0].count("|") for line in table)
    assert "agreement" not in lossless[0] and "KL to natural" in lossy[0]
    assert "modeled speed-up over AR" in lossy[0] and "1.234 [1.100, 1.300]" in lossy[2]
    assert "modeled speed-up over AR" not in lossless[0]  # no lossless point has a cost model's figure here
    table = lossless + lossy
    assert "`vat` at budget 4 meets the goal (score 0.99)." in lines
    assert vat4["goal_score_stepwise"] == pytest.approx(max(0.34375 / 0.70, 0.98 / 1.0, 0.95 / 0.99))
    assert vat["goal_score_stepwise"] == vat["goal_score"]  # natural routing: both agreements are 100 %
    assert ("Secondary (a metric added after the goal was set; the verdict is the line above): with the stepwise "
            "agreement in its place, `vat` at budget 4 meets the goal (score 0.98).") in lines
    assert "| vat | 4 |" in next(line for line in table if "96.0 % | 99.0 % | 0.0050 |" in line)

    # a seed the reference has not finished stays out of the point as out of its ratios; a sampled eval's natural
    # routing has no agreement figure (it is not the target's greedy output)
    rows[("vat", "none", "b")] = entry([0, 1, 2], [[44, 22], [33, 33], [90, 90]], [[10, 10], [10, 10], [10, 10]],
                                       [[110, 55], [82.5, 82.5], [10, 10]], [[44, 22], [33, 33], [90, 90]],
                                       greedy=False)
    vat = next(p for p in front_statistics(rows, ["eagle3", "vat"], "eagle3", boot)["b"]
               if (p["label"], p["budget"]) == ("vat", "none"))
    assert vat["seeds"] == [0, 1] and vat["tau"] == pytest.approx(3.3) and vat["mib_per_token"] == pytest.approx(2.5)
    assert vat["agreement"] is None and vat["stepwise_agreement"] is None and vat["goal_score"] == float("inf")


def test_a_method_evaluating_another_methods_drafts_is_drawn_in_its_colour(tmp_path):
    """`eagle3_at_budget` (draft: {bench_dir}/cells/eagle3/...) is eagle3's drafts under budgets: same colour, one
    legend entry; a draft outside the bench or the method's own cells keeps its own colour."""
    from vat.bench.plots import _drafted_by

    summary = _summary()
    summary["methods"] = [*summary["methods"], "eagle3_at_budget", "outside"]
    summary["settings"] = {"methods": {
        "eagle3_at_budget": {"draft": "{bench_dir}/cells/eagle3/seed{seed}/train/final"},
        "outside": {"draft": "runs/other/cells/eagle3/seed{seed}/train/final"},
        "eagle3": {"recipe": "tiny/eagle3.yaml"}}}
    assert _drafted_by(summary) == {"eagle3_at_budget": "eagle3"}
    summary["results"]["eagle3_at_budget"] = {"8": summary["results"]["eagle3"]["8"]}
    assert plot_pareto_bytes(summary, str(tmp_path / "p.png"))
