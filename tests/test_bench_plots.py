"""The bench's Pareto plot (τ against expert MiB per generated token) on a small bench.json fixture."""

from __future__ import annotations

import json
import os

from vat.bench.plots import pareto_points, plot_pareto_bytes, write_plots

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bench_small.json")


def _summary() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def test_pareto_points_are_every_method_x_budget_with_bytes_and_quality_beside_budgeted_ones():
    summary = _summary()
    points = pareto_points(summary, "spec_bench")
    keys = {(p["label"], p["budget"]) for p in points}
    # eagle3 and vat at natural routing and B = 8, 4; vat_union0.1 natural only; AR; ngram has no bytes in the fixture
    assert keys == {("eagle3", "none"), ("eagle3", "8"), ("eagle3", "4"), ("vat", "none"), ("vat", "8"),
                    ("vat", "4"), ("vat_union0.1", "none"), ("none", "none")}
    vat4 = next(p for p in points if p["label"] == "vat" and p["budget"] == "4")
    stats = summary["results"]["vat"]["4"]["spec_bench"]
    assert vat4["mib"] == stats["expert_mib_per_token"]["value"] and vat4["tau"] == stats["tau"]["value"]
    assert vat4["agreement"] == stats["quality"]["agreement"]
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
            assert "agreement | KL to natural" in rows[0]
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

    from vat.config import load_bench_config
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
