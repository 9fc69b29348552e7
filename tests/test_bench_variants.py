"""`vat bench` eval variants: methods that evaluate an existing draft (no training) under per-method eval overrides
(tree, EVICT, budget, cost model), side by side with intervals; cells resume and are keyed by their overrides; the
settings of benches that set none of the new keys are unchanged (their finished cells stay finished)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vat.bench.cells import Cell
from vat.bench.config import load_bench_config
from vat.bench.run import _draft_target
from vat.errors import VatError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_config(path, draft_root: str, tree: str = "2,2,4") -> str:
    text = f"""
name: variants
output_dir: {path}/bench
seeds: [0]
methods:
  chain:
    draft: {draft_root}/seed{{seed}}/final
  tree_evict:
    draft: {draft_root}/seed{{seed}}/final
    eval: {{tree: "{tree}", tree_policy: evict, cost_model: h200}}
  moespec2:
    draft: {draft_root}/seed{{seed}}/final
    eval: {{budgets: [2]}}
baselines: []
reference: chain
eval:
  benchmarks: [spec_bench]
  limit: 2
  max_new_tokens: 6
  steps: 3
  cost_model: h200
bootstrap: {{samples: 200}}
"""
    file = path / "variants.yaml"
    file.write_text(text)
    return str(file)


def _save_draft(root: str) -> str:
    from transformers import AutoConfig

    from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from vat.export.checkpoint import save_draft
    from vat.target.model import resolve_target_path

    target = resolve_target_path("tiny-quick")
    config = AutoConfig.from_pretrained(target)
    cfg = Eagle3Config.for_target(config, draft_vocab_size=config.vocab_size, target_path=target)
    torch.manual_seed(0)
    return save_draft(Eagle3Drafter(cfg), cfg, os.path.join(root, "seed0", "final"))


def test_existing_drafts_under_eval_variants_resume_and_are_keyed_by_overrides(tmp_path, capsys, one_thread):
    from vat.bench.cells import plan_cells
    from vat.bench.run import run_bench

    draft_root = str(tmp_path / "drafts")
    _save_draft(draft_root)
    config = _write_config(tmp_path, draft_root)
    bench = load_bench_config(config)
    cells = plan_cells(bench, str(tmp_path / "bench"))
    assert [(c.name, c.train_cfg, c.draft) for c in cells] == [
        (f"{m} seed 0", None, f"{draft_root}/seed0/final") for m in ("chain", "tree_evict", "moespec2")]

    summary = run_bench(bench, progress=False)
    assert summary["progress"]["complete"] and summary["budgets"] == ["none", "2"]
    assert not os.path.exists(tmp_path / "bench" / "cells" / "chain" / "seed0" / "train")  # nothing trained
    res = summary["results"]
    chain, evict = res["chain"]["none"]["spec_bench"], res["tree_evict"]["none"]["spec_bench"]
    for stats in (chain, evict, res["moespec2"]["2"]["spec_bench"]):
        for key in ("tau", "expert_mib_per_token", "modeled_speedup"):
            est = stats[key]
            assert est["low"] <= est["value"] <= est["high"], (key, est)
    assert res["moespec2"]["2"]["spec_bench"]["quality"]["agreement"] is not None  # a budget carries its quality
    assert 0 < res["moespec2"]["2"]["spec_bench"]["quality"]["stepwise_agreement"] <= 1
    # the chain cell's greedy run at natural routing left the prompts' natural decode; the budgeted cell read it
    moespec = json.loads((tmp_path / "bench" / "cells" / "moespec2" / "seed0" / "eval" / "eval.json").read_text())
    assert moespec["quality_reference"]["spec_bench"]["source"].startswith("natural greedy decode (cached")
    assert len(os.listdir(tmp_path / "bench" / "natural_reference")) == 1
    assert "none" not in res["moespec2"] and "2" not in res["chain"]
    assert evict["modeled_ratio"]["low"] <= evict["modeled_ratio"]["value"] <= evict["modeled_ratio"]["high"]
    ev = json.loads((tmp_path / "bench" / "cells" / "tree_evict" / "seed0" / "eval" / "eval.json").read_text())
    assert ev["settings"]["tree"] == {"top_k": 2, "depth": 2, "total_tokens": 4}
    assert ev["settings"]["tree_policy"] == "evict" and ev["settings"]["cost_model"] == "h200"
    md = (tmp_path / "bench" / "bench.md").read_text()
    assert "modeled h200 speed-up over AR" in md and "| tree_evict |" in md and "tree_policy=evict" in md

    # a rerun skips every cell; a changed override reruns that method's cell only
    capsys.readouterr()
    run_bench(load_bench_config(config), progress=False)
    assert capsys.readouterr().out.count("finished earlier, skipped") == 3
    run_bench(load_bench_config(_write_config(tmp_path, draft_root, tree="2,2,3")), progress=False)
    out = capsys.readouterr().out
    assert out.count("finished earlier, skipped") == 2 and "tree_evict seed 0: τ" in out


def _late_draft_bench(tmp_path) -> tuple[str, str]:
    """A bench whose second method evaluates a draft that appears only while the bench runs; (config, draft root)."""
    config = tmp_path / "late.yaml"
    config.write_text(f"""
name: late
output_dir: {tmp_path}/bench
seeds: [0]
methods:
  first:
    draft: {_save_draft(str(tmp_path / "drafts"))}
  later:
    draft: "{{bench_dir}}/made/seed{{seed}}/final"
baselines: []
reference: first
eval: {{benchmarks: [spec_bench], limit: 1, max_new_tokens: 4, steps: 2}}
bootstrap: {{samples: 50}}
""")
    return str(config), str(tmp_path / "bench" / "made")  # _save_draft writes <root>/seed0/final


def test_a_draft_made_by_an_earlier_cell_is_hashed_when_its_cell_runs(tmp_path, capsys, monkeypatch, one_thread):
    # tiny_budget / tiny_union evaluate a draft that an earlier cell of the same bench trains: hashed at the start
    # (missing), the cell's record kept a fingerprint a rerun never matched, so every rerun evaluated it again
    import vat.bench.run as bench_run

    config, late_root = _late_draft_bench(tmp_path)
    real_run_cell = bench_run.run_cell

    def run_cell_then_make_the_draft(bench, cell, *args, **kwargs):
        record = real_run_cell(bench, cell, *args, **kwargs)
        if cell.method == "first":  # what a training cell does: the next cell's draft appears
            _save_draft(late_root)
        return record

    monkeypatch.setattr(bench_run, "run_cell", run_cell_then_make_the_draft)
    assert bench_run.run_bench(load_bench_config(config), progress=False)["progress"]["complete"]
    capsys.readouterr()
    bench_run.run_bench(load_bench_config(config), progress=False)
    assert capsys.readouterr().out.count("finished earlier, skipped") == 2


def test_a_shard_counts_a_cell_another_shard_finished_on_a_draft_made_while_it_ran(tmp_path, monkeypatch, one_thread):
    # two shards (`--methods first` | `--methods later`): `later`'s draft did not exist when the first shard started,
    # so its tables, written with the fingerprints of that moment, left out the cell the other shard finished
    import vat.bench.run as bench_run

    config, late_root = _late_draft_bench(tmp_path)
    real_run_cell = bench_run.run_cell

    def run_cell_while_the_other_shard_finishes(bench, cell, *args, **kwargs):
        record = real_run_cell(bench, cell, *args, **kwargs)
        if cell.method == "first":
            _save_draft(late_root)  # the draft appears, and the other shard evaluates it
            assert bench_run.run_bench(load_bench_config(config), progress=False, only=["later"])
        return record

    monkeypatch.setattr(bench_run, "run_cell", run_cell_while_the_other_shard_finishes)
    summary = bench_run.run_bench(load_bench_config(config), progress=False, only=["first"])
    assert summary["progress"] == {"cells_done": 2, "cells_total": 2, "complete": True}
    assert summary["results"]["later"]["none"]["spec_bench"]["seeds"] == [0]


def test_methods_on_their_own_targets_run_side_by_side(tmp_path, capsys, one_thread):
    # the Window Pool comparison: the same draft on the base target and on a second target, one bench, one table
    import shutil

    from vat.bench.cells import plan_cells, train_config
    from vat.bench.run import run_bench
    from vat.target.model import resolve_target_path

    base = resolve_target_path("tiny-quick")
    other = str(tmp_path / "other-target")
    shutil.copytree(base, other, ignore=shutil.ignore_patterns("*.lock"))
    draft = _save_draft(str(tmp_path / "drafts"))
    config = tmp_path / "targets.yaml"
    config.write_text(f"""
name: targets
output_dir: {tmp_path}/bench
seeds: [0]
methods:
  on_base:
    draft: {draft}
  on_other:
    draft: {draft}
    target: {other}
  trained_on_other:
    recipe: tiny/eagle3.yaml
    overrides: [target.path=tiny-quick]
    target: {other}
baselines: []
reference: on_base
eval: {{benchmarks: [spec_bench], limit: 1, max_new_tokens: 4, steps: 2}}
bootstrap: {{samples: 50}}
""")
    bench = load_bench_config(str(config))
    cells = plan_cells(bench, str(tmp_path / "bench"))
    assert [c.target for c in cells] == [None, other, other]
    # the method's own target wins over a target.path override; the others' shared target is untouched
    assert train_config(bench, "trained_on_other", 0, cells[2].directory).target.path == other
    del bench.methods["trained_on_other"]  # the run: the two draft cells (training is covered elsewhere)
    summary = run_bench(bench, progress=False)
    assert summary["target"] == base and summary["progress"]["complete"]
    for label, target in (("on_base", base), ("on_other", other)):
        settings = json.loads((tmp_path / "bench" / "cells" / label / "seed0" / "eval" / "bench_settings.json")
                              .read_text())
        assert settings["target"] == target
    md = (tmp_path / "bench" / "bench.md").read_text()
    assert "| target |" in md and f"| on_other | {draft} | {other} |" in md
    assert summary["results"]["on_other"]["none"]["spec_bench"]["ratio"]["value"] > 0
    capsys.readouterr()
    run_bench(bench, progress=False)
    assert capsys.readouterr().out.count("finished earlier, skipped") == 2


def test_methods_on_different_targets_without_their_own_target_key_are_refused(tmp_path):
    from vat.bench.cells import plan_cells

    config = tmp_path / "mixed.yaml"
    config.write_text("""
name: mixed
seeds: [0]
methods:
  a: {recipe: tiny/eagle3.yaml, overrides: [target.path=tiny-quick]}
  b: {recipe: tiny/eagle3.yaml, overrides: [target.path=/elsewhere]}
reference: a
""")
    with pytest.raises(VatError, match=r"different targets.*methods.<label>.target"):
        plan_cells(load_bench_config(str(config)), str(tmp_path / "bench"))


def test_settings_of_benches_without_variants_are_unchanged():
    from vat.bench.cells import eval_settings

    for name in ("tiny.yaml", "tiny_import.yaml", "tiny_quick.yaml"):
        bench = load_bench_config(os.path.join(REPO, "recipes", "bench", name))
        for method in [None, *bench.methods]:
            ev = bench.eval
            assert eval_settings(bench, method=method) == {
                "benchmarks": list(ev.benchmarks), "limit": ev.limit, "max_new_tokens": ev.max_new_tokens,
                "steps": ev.steps, "temperature": ev.temperature, "budgets": list(ev.budgets)}


def test_variant_config_errors_are_one_line(tmp_path):
    config = _write_config(tmp_path, str(tmp_path / "nowhere"))
    for override, message in [
        ("methods.chain.eval.tree_policy=evicts", "one of confidence, evict"),
        ("methods.chain.eval.policy=acceptmo", "`methods.chain.eval.policy`: one of substitute, truncate, truncate_cover, acceptmoe"),
        ("eval.policy=drop", "`eval.policy`: one of substitute"),
        ("methods.chain.eval.cost_model=b200", "known accelerators are h100, h200, a100, l40s"),
        ("methods.chain.recipe=tiny/eagle3.yaml", "not both"),
        ("methods.chain.eval.tree=4,4", "top_k,depth,total_tokens"),
    ]:
        with pytest.raises(VatError, match=message):
            load_bench_config(config, [override])
    from vat.bench.run import run_bench

    with pytest.raises(VatError, match="draft .*nowhere/seed0/final not found"):
        run_bench(load_bench_config(config), progress=False)


@pytest.mark.parametrize("recipe", sorted(os.listdir(os.path.join(REPO, "recipes", "bench"))))
def test_every_bench_recipe_loads_and_plans(recipe, tmp_path):
    from vat.bench.cells import plan_cells

    bench = load_bench_config(os.path.join(REPO, "recipes", "bench", recipe))
    cells = plan_cells(bench, str(tmp_path / "bench"))
    assert len(cells) == len(bench.methods) * len(bench.seeds) + len(bench.baselines)
    if recipe == "tiny_window_pool.yaml":  # the Window Pool method trains for its own target, base for the tiny one
        own = {c.method: c.train_cfg.target.path for c in cells if c.seed == 0}
        assert own["base"] == "tiny" and own["window_pool"].endswith("runs/tiny-window_pool/final")


def test_the_bench_target_is_the_shared_one_else_the_first_own_target(tmp_path):
    from vat.bench.cells import Cell
    from vat.bench.run import _bench_target

    draft = _save_draft(str(tmp_path / "drafts"))  # records the tiny-quick target as its target_path
    own = str(tmp_path / "own")
    shared = Cell("a", 0, str(tmp_path / "a"), draft=draft)
    elsewhere = Cell("b", 0, str(tmp_path / "b"), draft=draft, target=own)
    assert _bench_target([elsewhere, shared]) != own  # a method without its own target decides
    assert _bench_target([elsewhere]) == own  # every method on its own target: the first one's


def test_a_record_of_draft_cells_renders_without_its_drafts(tmp_path):
    """A committed record of a bench that evaluates existing drafts re-renders where the drafts are absent: the
    target comes from the finished cell's eval.json; a missing draft with no record still stops in one line."""
    cell = Cell(method="m", seed=0, directory=str(tmp_path / "cells" / "m" / "seed0"), draft=str(tmp_path / "gone"))
    with pytest.raises(VatError, match="not found"):
        _draft_target([cell], recorded=True)  # no record either
    os.makedirs(os.path.join(cell.directory, "eval"))
    with open(os.path.join(cell.directory, "eval", "eval.json"), "w") as f:
        json.dump({"target": "/somewhere/tiny-target"}, f)
    assert _draft_target([cell], recorded=True) == "/somewhere/tiny-target"
    with pytest.raises(VatError, match="not found"):
        _draft_target([cell])  # a run (not a render) needs the draft itself
