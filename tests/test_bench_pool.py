"""vat.bench.pool: one paired ratio pooled over the records of several target builds."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from vat.bench.pool import pool_ratio, pooled_markdown
from vat.errors import VatError

MATCHED = os.path.join(os.path.dirname(__file__), "..", "docs", "bench", "tiny_dflash_matched")
SETTINGS = {"mode": "chain", "steps": 7, "tree": None, "temperature": 0.0, "budgets": ["none"],
            "policy": "substitute", "max_new_tokens": 64, "limit": None}


def _cell(record, label: str, seed: int, kept: list[int], rounds: list[int], ids=None, **settings) -> None:
    """A finished cell's eval.json as a full (not compacted) vat eval writes it: one benchmark, natural routing."""
    ids = ids or list(range(len(kept)))
    prompts = [{"question_id": i, "kept": k, "committed": k + 1, "rounds": r} for i, k, r in zip(ids, kept, rounds)]
    path = os.path.join(record, "cells", label, f"seed{seed}", "eval")
    os.makedirs(path)
    with open(os.path.join(path, "eval.json"), "w") as f:
        json.dump({"settings": {**SETTINGS, **settings}, "per_prompt": {label: {"none": {"b@test": prompts}}}}, f)


def test_rows_of_two_builds_pool_into_one_ratio_with_a_t_interval_over_them(tmp_path):
    """Two builds, three (build, seed) rows: τ pooled over rows and prompts, the per-row ratios and the t interval
    over the rows, all computed by hand."""
    a, b = tmp_path / "build_a", tmp_path / "build_b"
    _cell(a, "vat", 0, [10, 20], [5, 10])      # τ 2
    _cell(a, "ctl", 0, [8, 16], [8, 8])        # τ 1.5
    _cell(a, "vat", 1, [9, 9], [3, 3])         # τ 3 ; a seed whose control never finished is left out
    _cell(b, "vat", 3, [12, 12], [6, 6])       # τ 2
    _cell(b, "ctl", 3, [12, 12], [6, 6])       # τ 2
    _cell(b, "vat", 4, [30, 30], [10, 10])     # τ 3
    _cell(b, "ctl", 4, [20, 20], [10, 10])     # τ 2
    pooled = pool_ratio([str(a), str(b)], "vat", "ctl", samples=500)["b@test"]
    assert pooled["rows"] == 3 and pooled["n_prompts"] == 2
    assert pooled["tau"]["method"] == pytest.approx((30 + 24 + 60) / (15 + 12 + 20))
    assert pooled["tau"]["reference"] == pytest.approx((24 + 24 + 40) / (16 + 12 + 20))
    ratio = pooled["ratio"]
    assert ratio["value"] == pytest.approx(((30 + 24 + 60) / 47) / ((24 + 24 + 40) / 48))
    assert ratio["per_seed"] == pytest.approx({"build_a:seed0": 2 / 1.5, "build_b:seed3": 1.0, "build_b:seed4": 1.5})
    values = [2 / 1.5, 1.0, 1.5]
    mean = sum(values) / 3
    sd = (sum((v - mean) ** 2 for v in values) / 2) ** 0.5
    half = 4.302652729911275 * sd / 3 ** 0.5  # Student's t, 2 degrees of freedom, 97.5 %
    assert ratio["t"]["low"] == pytest.approx(mean - half, abs=1e-6)
    assert ratio["t"]["high"] == pytest.approx(mean + half, abs=1e-6)
    assert ratio["low"] <= ratio["value"] <= ratio["high"]
    assert "build_b:seed4" in pooled_markdown({"b@test": pooled}, "vat", "ctl")


def test_a_committed_bench_split_into_two_records_pools_back_to_its_own_figures(tmp_path):
    """The full target's matched DFlash bench (5 seeds, one build), split into two records of seeds 0-2 and 3-4, pools
    to the figures the bench itself rendered (bench.json, computed through the bench's own cell tables)."""
    with open(os.path.join(MATCHED, "bench.json")) as f:
        rendered = json.load(f)["results"]["dflash_vat"]["none"]
    parts = {"first": [0, 1, 2], "second": [3, 4]}
    for part, seeds in parts.items():
        for label in ("dflash_vat", "dflash_matched"):
            for seed in seeds:
                shutil.copytree(os.path.join(MATCHED, "cells", label, f"seed{seed}"),
                                tmp_path / part / "cells" / label / f"seed{seed}")
    pooled = pool_ratio([str(tmp_path / p) for p in parts], "dflash_vat", "dflash_matched")
    for bench in ("spec_bench@test", "humaneval@test"):
        want, got = rendered[bench]["ratio"], pooled[bench]["ratio"]
        assert pooled[bench]["rows"] == 5
        assert list(got["per_seed"].values()) == pytest.approx(list(want["per_seed"].values()))
        for key in ("value", "low", "high"):
            assert got[key] == pytest.approx(want[key])
            assert got["t"][key] == pytest.approx(want["t"][key])


def test_records_that_do_not_pair_are_refused_in_one_line(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _cell(a, "vat", 0, [4, 4], [2, 2])
    _cell(a, "ctl", 0, [4, 4], [2, 2])
    with pytest.raises(VatError, match="named twice"):
        pool_ratio([str(a), str(a)], "vat", "ctl")
    with pytest.raises(VatError, match="no record has both"):
        pool_ratio([str(a)], "vat", "other")
    _cell(b, "vat", 1, [4, 4], [2, 2], ids=[7, 8])
    _cell(b, "ctl", 1, [4, 4], [2, 2], ids=[7, 8])
    with pytest.raises(VatError, match="prompts of b@test differ"):
        pool_ratio([str(a), str(b)], "vat", "ctl")
    shutil.rmtree(b)
    _cell(b, "vat", 1, [4, 4], [2, 2], temperature=1.0)
    _cell(b, "ctl", 1, [4, 4], [2, 2], temperature=1.0)
    with pytest.raises(VatError, match="other eval settings.*temperature"):
        pool_ratio([str(a), str(b)], "vat", "ctl")
