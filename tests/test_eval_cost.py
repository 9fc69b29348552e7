"""`vat eval --cost-model` and `--tree-policy evict` end to end on a saved tiny target and draft: the modeled figures
in eval.json reproduce from the per-prompt counts, AR models at exactly 1x, EVICT stays lossless, and bad input is one
line."""

from __future__ import annotations

import json
import os

import pytest

from vat.cli import main as cli_main
from vat.eval.run import run_eval

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cost_model_and_evict_in_eval_json(saved_target_and_draft, spec_bench_file):
    root, target_dir, draft_dir = saved_target_and_draft
    out = str(root / "cost")
    result = run_eval(target=target_dir, drafts=[draft_dir, "ngram"], benchmarks=[spec_bench_file], limit=2,
                      max_new_tokens=12, steps=4, tree_policy="evict", cost_model="a100", output=out,
                      progress=False)
    assert result["settings"]["cost_model"] == "a100" and result["settings"]["tree_policy"] == "evict"
    assert result["cost_model"]["hbm_bytes_per_s"] == 2.039e12 and result["cost_model"]["served_bytes"] == 2
    # the plain preset is the pure bytes model, and says so
    assert (result["cost_model"]["eta"], result["cost_model"]["latency_us"]) == (1.0, 0.0)
    assert result["cost_model"]["kind"] == "bytes model"
    (profile,) = result["evict_profile"].values()  # one benchmark (a file: no dev split, fitted on its own prompts)
    # the trained draft's cost profile comes from its own blocks of the calibration pass (the text profile is unused)
    assert profile["verify_cost"] is None
    (drafted,) = profile["verify_cost_drafted"].values()
    assert drafted["source"].startswith("on the fly: ") and "own blocks" in drafted["source"]
    assert drafted["widths"] == [1, 2, 3, 4, 5] and drafted["modeled_seconds"] is not None
    assert all(a <= b for a, b in zip(drafted["union"][0], drafted["union"][-1]))  # a wider prefix covers more
    (calibration,) = profile["calibration"].values()  # the trained draft's (the n-gram draft is never cut)
    assert "no dev split" in calibration["source"] and calibration["nodes"] > 0
    bench = result["benchmarks"][0]
    for label, per_budget in result["per_prompt"].items():
        entries = per_budget["none"][bench]
        cost = result["results"][label]["none"][bench]["cost"]
        spent = sum(e["modeled_seconds"] for e in entries)
        ar = sum(e["modeled_ar_seconds"] for e in entries)
        kept = sum(e["kept"] for e in entries)
        assert cost["modeled_speedup_vs_ar"] == pytest.approx(ar / spent)
        assert cost["modeled_tokens_per_s"] == pytest.approx(kept / spent)
        assert result["pooled"][label]["none"]["cost"]["modeled_speedup_vs_ar"] == pytest.approx(ar / spent)
    # autoregressive decoding priced against itself: the same forwards, exactly 1x
    assert result["results"]["none"]["none"][bench]["cost"]["modeled_speedup_vs_ar"] == pytest.approx(1.0)
    assert result["results"]["none"]["none"][bench]["cost"]["modeled_draft_seconds"] == 0.0
    # EVICT is lossless: every draft's output is the AR output, token for token
    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    by_draft = {}
    for row in rows:
        by_draft.setdefault(row["draft"], []).append(row["token_ids"])
    assert len(by_draft) == 3
    assert all(ids == by_draft["none"] for ids in by_draft.values())
    report = open(os.path.join(out, "report.md")).read()
    assert "### Modeled cost" in report and "modeled speed-up over AR" in report and "tree policy evict" in report
    assert "bytes model" in report and "η = 1 and latency = 0 µs" in report
    with open(os.path.join(out, "modeled_speedup.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags,message", [
    (["--cost-model", "b200"], "unknown cost model `b200`: known accelerators are h100, h200, a100, l40s "
                               "(knobs: `h200@eta=0.8,latency_us=10`)"),
    (["--cost-model", "h200@eta=2"], "cost model `h200@eta=2`: eta must be in (0, 1], got 2"),
    (["--verify-cost", "nowhere.json"], "--verify-cost is EVICT's profile: add --tree-policy evict"),
    (["--tree-policy", "evict", "--verify-cost", "nowhere.json"],
     "--verify-cost nowhere.json: no such file (write it with `vat profile --verify-widths ...`)"),
])
def test_cost_flags_user_errors_are_one_line(saved_target_and_draft, spec_bench_file, capsys, flags, message):
    root, target_dir, draft_dir = saved_target_and_draft
    rc = cli_main(["eval", "--target", target_dir, "--draft", draft_dir, "--benchmark", spec_bench_file, "--limit", "1",
                   "--max-new-tokens", "4", "--output", str(root / "bad"), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"vat: error: {message}"


def test_profile_writes_the_verify_cost_table_evict_reads(saved_target_and_draft, spec_bench_file):
    root, target_dir, draft_dir = saved_target_and_draft
    prof = str(root / "profile")
    assert cli_main(["profile", "--target", target_dir, "--benchmark", spec_bench_file, "--limit", "2",
                     "--verify-widths", "1,2,4", "--new-tokens", "8", "--cost-model", "l40s", "--output", prof]) == 0
    with open(os.path.join(prof, "profile.json")) as f:
        table = json.load(f)["verify_cost"]
    assert table["widths"] == [1, 2, 4] and table["accelerator"] == "l40s" and len(table["measured_seconds"]) == 3
    assert table["union"][0] == [2.0, 2.0]  # one token: its own top-2 in each of the 2 MoE layers
    assert "Verification cost against width" in open(os.path.join(prof, "profile.md")).read()
    result = run_eval(target=target_dir, drafts=[draft_dir], benchmarks=[spec_bench_file], limit=1, max_new_tokens=8,
                      steps=3, tree_policy="evict", verify_cost=os.path.join(prof, "profile.json"), progress=False,
                      autoregressive=False)
    (profile,) = result["evict_profile"].values()
    assert profile["verify_cost"]["widths"] == [1, 2, 4] and result["settings"]["verify_cost"].endswith(
        "profile.json")
