"""The README's main job and the CI smoke runs, for real, on the embedded tiny target (quick build).

``vat demo --quick`` builds (or reuses) the quick tiny target and its own answers to ShareGPT prompts, trains EAGLE-3,
EAGLE-3 + VAT and DFlash + VAT, evaluates them with real speculative decoding beside n-gram lookup and writes the report. Then the recipe smoke run
(``train.max_steps=20``), ``vat eval`` on the trained draft, and ``vat export`` to both engines' layouts.
"""

from __future__ import annotations

import json
import os

import pytest

from vat.cli import main as vat_main

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "quick"
    assert vat_main(["demo", "--quick", "--output", str(out)]) == 0
    return out


def test_demo_quick_writes_report_tables_and_plots(demo_dir):
    report = (demo_dir / "report.md").read_text()
    assert "| eagle3 |" in report and "| eagle3+vat |" in report and "| dflash+vat |" in report
    for heading in ("spec_bench", "humaneval"):
        assert f"### {heading}" in report
    for budget in ("| none |", "| 6 |", "| 4 |"):
        assert budget in report
    assert "| benchmark | budget B | τ eagle3 | τ eagle3+vat | τ dflash+vat |" in report
    assert "DFlash blocks of 8 for `dflash+vat`" in report
    assert "## What the target answered" in report and "**humaneval**" in report
    head = json.loads((demo_dir / "demo.json").read_text())["headline"]
    assert [(r["benchmark"], r["budget"]) for r in head] == [
        (b, B) for b in ("spec_bench", "humaneval") for B in ("none", "6", "4")]
    for row in head:
        for draft in ("eagle3", "eagle3+vat", "dflash+vat"):
            assert row[draft]["tau"] >= 1.0 and row[draft]["expert_mib_per_token"] > 0
            if row["budget"] != "none":
                assert row[draft]["union_per_round"] <= int(row["budget"])
    pngs = sorted(p.name for p in demo_dir.glob("*.png"))
    assert "training_tau_sim.png" in pngs and len(pngs) >= 4
    for png in pngs:
        assert (demo_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ev = json.loads((demo_dir / "eval" / "eval.json").read_text())
    assert set(ev["results"]) == {"eagle3", "eagle3+vat", "dflash+vat", "ngram", "none"}  # the demo's names
    assert ev["drafts"]["dflash+vat"]["mode"] == "block" and ev["drafts"]["dflash+vat"]["block_size"] == 8
    # the headline's τ ratios: VAT over EAGLE-3 and each draft over n-gram lookup, with intervals around the point
    assert "τ eagle3+vat / eagle3 [95 % CI]" in report and "τ eagle3 / ngram [95 % CI]" in report
    for row in head:
        assert set(row["ratios"]) == {"eagle3+vat/eagle3", "dflash+vat/eagle3", "eagle3/ngram", "eagle3+vat/ngram",
                                      "dflash+vat/ngram"}
        for name, est in row["ratios"].items():
            assert est["low"] <= est["value"] <= est["high"], (row["benchmark"], row["budget"], name)
        taus = (row["eagle3+vat"]["tau"], row["eagle3"]["tau"])
        assert abs(row["ratios"]["eagle3+vat/eagle3"]["value"] - taus[0] / taus[1]) < 1e-9
    for label, per_budget in ev["results"].items():
        for budget, per_bench in per_budget.items():
            for bench, m in per_bench.items():
                assert m["n_prompts"] >= 1 and m["n_rounds"] >= 1, (label, budget, bench)
                if budget != "none":
                    assert m["union_per_round"]["max"] <= int(budget)


def test_recipe_smoke_train_eval_export(demo_dir, tmp_path):
    run = tmp_path / "smoke"
    rc = vat_main(["train", os.path.join(RECIPES, "eagle3_vat.yaml"), "target.path=tiny-quick", "train.max_steps=20",
                   f"output_dir={run}", "train.save_every=10", "logging.progress=false"])
    assert rc == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21))
    assert lines[-1]["loss"] < lines[0]["loss"]
    final = str(run / "final")
    assert vat_main(["eval", "--draft", final, "--draft", "none", "--benchmark", "spec_bench", "--limit", "2",
                     "--max-new-tokens", "16", "--output", str(tmp_path / "eval")]) == 0
    ev = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert ev["benchmarks"] == ["spec_bench"]
    for fmt in ("sglang", "speculators"):
        out = tmp_path / f"export_{fmt}"
        assert vat_main(["export", final, "--format", fmt, "--output", str(out)]) == 0
        assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    # an exported draft evaluates like the original (same greedy tokens)
    assert vat_main(["eval", "--draft", str(tmp_path / "export_sglang"), "--benchmark", "spec_bench", "--limit", "1",
                     "--max-new-tokens", "12", "--output", str(tmp_path / "eval_sglang")]) == 0
