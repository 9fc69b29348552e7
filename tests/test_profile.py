"""`vat profile` end to end on a tiny random OLMoE saved with save_pretrained, over Spec-Bench prompts."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_target

from vat.cli import main as vat_main


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("olmoe") / "target", "olmoe", num_experts=8, top_k=2)


def _profile(tmp_path, target, bench, *extra):
    out = tmp_path / ("p" + "_".join(extra).replace("-", ""))
    rc = vat_main(["profile", "--target", target, "--benchmark", bench, "--limit", "8", "--max-length", "64",
                   "--output", str(out), *extra])
    assert rc == 0
    return json.loads((out / "profile.json").read_text())


def test_profile_budget_equal_num_experts_is_exact(tmp_path, olmoe_dir, spec_bench_file):
    r = _profile(tmp_path, olmoe_dir, spec_bench_file, "--window", "8", "--budget", "8")
    assert r["kl_to_unbudgeted"] == 0.0
    for key in ("num_layers", "num_experts", "top_k", "window", "budget", "mean_union", "union_by_layer",
                "max_union", "expert_bytes_per_window", "kl_to_unbudgeted"):
        assert key in r
    assert r["num_experts"] == 8 and r["top_k"] == 2 and r["n_prompts"] == 8


def test_profile_small_budget_caps_union_and_costs_kl(tmp_path, olmoe_dir, spec_bench_file):
    r = _profile(tmp_path, olmoe_dir, spec_bench_file, "--window", "8", "--budget", "2")
    assert r["max_union"] <= 2
    assert r["natural_max_union"] > 2
    assert r["kl_to_unbudgeted"] > 0


def test_profile_union_grows_with_window(tmp_path, olmoe_dir, spec_bench_file):
    unions = [_profile(tmp_path, olmoe_dir, spec_bench_file, "--window", str(w))["mean_union"] for w in (1, 4, 8)]
    assert unions[0] == pytest.approx(2.0)  # one token: exactly its top-k
    assert unions[0] < unions[1] < unions[2]


def test_profile_loads_as_asked_and_counts_uncovered_tokens(tmp_path, olmoe_dir, spec_bench_file):
    """--experts-impl/--dtype/--device reach the loader and are recorded; truncation at B = 2 meets tokens with no
    natural expert in the budget set (substituted, counted); a budget of E meets none."""
    r = _profile(tmp_path, olmoe_dir, spec_bench_file, "--window", "8", "--budget", "2", "--policy", "truncate",
                 "--experts-impl", "eager", "--dtype", "float32", "--device", "cpu")
    assert (r["experts_impl"], r["dtype"], r["device"]) == ("eager", "float32", "cpu")
    assert 0 < r["uncovered_fraction"] < 1
    assert r["natural_forward_seconds"] > 0 and r["budgeted_forward_seconds"] > 0
    full = _profile(tmp_path, olmoe_dir, spec_bench_file, "--window", "8", "--budget", "8")
    assert full["uncovered_fraction"] == 0.0 and full["experts_impl"] == "grouped_mm"
