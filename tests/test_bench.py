"""`vat bench`: the bootstrap statistics on synthetic counts, the config's checks, and the quick bench end to end.

The end-to-end test runs ``recipes/bench/tiny_quick.yaml`` through the CLI on the quick tiny target (2 seeds x 2
methods, 8 steps, 3 prompts per benchmark), then reruns it and checks that every finished cell is skipped.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from vat.bench.config import load_bench_config
from vat.bench.stats import (
    Estimate,
    bootstrap_tau,
    is_win,
    paired_ratio,
    per_seed_ratios,
    per_seed_tau,
    pooled_tau,
    replicate_taus,
    student_t_quantile,
    t_interval,
)
from vat.errors import VatError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(REPO, "recipes", "bench", "tiny_quick.yaml")


def _counts(rng: np.random.Generator, seeds: int, prompts: int) -> tuple[np.ndarray, np.ndarray]:
    rounds = rng.integers(5, 40, size=(seeds, prompts)).astype(float)  # (S, P)
    committed = rounds * rng.uniform(1.0, 3.0, size=(seeds, prompts))  # (S, P): τ of each prompt in [1, 3]
    return np.round(committed), rounds


# ---- statistics ---------------------------------------------------------------------------------------------------


def test_pooled_tau_is_a_ratio_of_sums_not_a_mean_of_ratios():
    committed = np.array([[2.0, 30.0]])
    rounds = np.array([[1.0, 20.0]])
    assert pooled_tau(committed, rounds) == pytest.approx(32 / 21)
    assert per_seed_tau(np.array([[2.0], [6.0]]), np.array([[1.0], [2.0]])) == [2.0, 3.0]


def test_replicates_of_unit_weights_are_the_point_estimate():
    c, r = _counts(np.random.default_rng(0), 3, 7)
    taus = replicate_taus(c, r, np.ones((2, 3)), np.ones((2, 7)))
    assert taus == pytest.approx([pooled_tau(c, r)] * 2)


def test_identical_inputs_give_ratio_one_with_a_degenerate_interval():
    c, r = _counts(np.random.default_rng(1), 3, 20)
    est = paired_ratio(c, r, c.copy(), r.copy(), samples=500)
    assert (est.value, est.low, est.high) == (1.0, 1.0, 1.0)


def test_exact_multiple_gives_that_ratio_with_a_tight_interval():
    c, r = _counts(np.random.default_rng(2), 3, 30)
    est = paired_ratio(1.1 * c, r, c, r, samples=500)
    assert est.value == pytest.approx(1.1)
    assert est.low == pytest.approx(1.1) and est.high == pytest.approx(1.1)  # pairing cancels prompt variance


def test_unpaired_noise_widens_the_interval_and_pairing_narrows_it():
    rng = np.random.default_rng(3)
    c, r = _counts(rng, 3, 30)
    noisy = c * rng.uniform(0.9, 1.1, size=c.shape)
    paired = paired_ratio(noisy, r, c, r, samples=500)
    shuffled = paired_ratio(noisy[:, rng.permutation(30)], r[:, rng.permutation(30)], c, r, samples=500)
    assert paired.low <= paired.value <= paired.high
    assert paired.high - paired.low < shuffled.high - shuffled.low


def test_single_seed_and_baseline_without_seeds():
    c, r = _counts(np.random.default_rng(4), 1, 15)
    tau = bootstrap_tau(c, r, samples=300)
    assert tau.low <= tau.value <= tau.high and tau.low < tau.high
    ratio = paired_ratio(c, r, c, r, samples=300)
    assert (ratio.low, ratio.high) == (1.0, 1.0)
    # a baseline (one row) against a 3-seed reference: pairs over prompts, the reference's seeds resampled
    ref_c, ref_r = _counts(np.random.default_rng(5), 3, 15)
    ar = paired_ratio(r, r, ref_c, ref_r, samples=300)  # AR: committed = rounds, τ = 1
    assert ar.value == pytest.approx(1.0 / pooled_tau(ref_c, ref_r))
    assert ar.low <= ar.value <= ar.high


def test_mismatched_shapes_are_refused():
    c, r = _counts(np.random.default_rng(6), 3, 10)
    with pytest.raises(ValueError, match="prompts"):
        paired_ratio(c[:, :9], r[:, :9], c, r)
    with pytest.raises(ValueError, match="seeds"):
        paired_ratio(c[:2], r[:2], c, r)


def _noisy(rng: np.random.Generator, rounds: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """Committed counts (S, P): τ ``mu`` per prompt, a small per-seed training effect, per-prompt sampling noise."""
    luck = np.exp(rng.normal(0.0, 0.01, size=(rounds.shape[0], 1)))  # (S, 1)
    return rounds * mu * luck + rng.normal(0.0, 0.6, size=rounds.shape) * np.sqrt(rounds)


def test_interval_coverage_on_a_known_ratio():
    """Prompts drawn from a population where the method commits 1.1x the reference per round, with per-prompt noise
    and a small per-seed effect: the 95 % paired interval should cover 1.1 in most experiments (not all: with three
    seeds the seed resampling is itself noisy)."""
    rng = np.random.default_rng(7)
    true, hits, widths, n = 1.1, 0, [], 120
    for i in range(n):
        rounds = np.tile(rng.integers(20, 60, size=40).astype(float), (3, 1))  # (S, P)
        mu = rng.uniform(1.2, 2.2, size=40)  # (P,) the reference's τ on each prompt
        ref, method = _noisy(rng, rounds, mu), _noisy(rng, rounds, true * mu)
        est = paired_ratio(method, rounds, ref, rounds, samples=300, seed=i)
        hits += est.low <= true <= est.high
        widths.append(est.high - est.low)
    assert 0.85 <= hits / n <= 1.0
    assert 0.01 < np.mean(widths) < 0.2


def test_t_interval_on_a_hand_computed_case():
    # per-seed ratios 1.39, 1.05, 1.07: mean 1.17, sd 0.19079, t_{0.975, 2} = 4.302653 (tables)
    est = t_interval([1.39, 1.05, 1.07])
    half = 4.302653 * 0.190788 / 3 ** 0.5
    assert est.value == pytest.approx(1.17) and est.low == pytest.approx(1.17 - half, abs=1e-5)
    assert est.high == pytest.approx(1.17 + half, abs=1e-5) and est.low == pytest.approx(0.696, abs=1e-3)
    for p, df, table in [(0.975, 1, 12.706205), (0.975, 4, 2.776445), (0.95, 10, 1.812461), (0.995, 30, 2.749996),
                         (0.025, 3, -3.182446)]:
        assert student_t_quantile(p, df) == pytest.approx(table, abs=1e-5)
    assert t_interval([1.2]) is None and t_interval([]) is None  # one seed: no seed-level interval


def test_per_seed_ratios_and_the_win_rule():
    c = np.array([[6.0, 6.0], [9.0, 3.0]])  # (S, P)
    r = np.array([[3.0, 3.0], [3.0, 3.0]])
    ref_c = np.array([[4.0, 4.0], [4.0, 4.0]])
    assert per_seed_ratios(c, r, ref_c, r) == pytest.approx([1.5, 1.5])
    assert per_seed_ratios(c, r, ref_c[:1], r[:1]) == pytest.approx([1.5, 1.5])  # a seedless baseline: every row
    tight, wide = Estimate(1.2, 1.1, 1.3), Estimate(1.2, 0.9, 1.5)
    assert is_win(tight, tight) and not is_win(tight, wide) and not is_win(wide, tight)
    assert not is_win(tight, None)  # one seed is never a win


def test_delivered_tau_counts_no_token_past_the_cap(tmp_path):
    """A hand-built cell, K = 3: prompt a's 3 rounds accept 3 each (12 committed) but only 9 tokens fit under its cap;
    prompt b's 2 rounds deliver all 8. τ = (9 + 8) / 5 <= K + 1, and Σ (accepted + 1) / rounds = 20 / 5 beside it."""
    from types import SimpleNamespace

    from vat.bench.cells import Cell
    from vat.bench.summary import markdown, method_statistics, per_prompt_table

    cell = Cell("vat", 0, str(tmp_path / "vat"))
    os.makedirs(os.path.join(cell.directory, "eval"))
    per_prompt = {"none": {"sb": [{"question_id": "a", "committed": 12, "kept": 9, "rounds": 3},
                                  {"question_id": "b", "committed": 8, "kept": 8, "rounds": 2}]}}
    with open(os.path.join(cell.directory, "eval", "eval.json"), "w") as f:
        json.dump({"settings": {"temperature": 0.0}, "per_prompt": {"vat": per_prompt}}, f)
    boot = SimpleNamespace(samples=100, seed=0, confidence=0.95)
    stats = method_statistics(per_prompt_table([cell]), ["vat"], "vat", boot)["vat"]["none"]["sb"]
    assert stats["tau"]["value"] == pytest.approx(17 / 5) and stats["tau"]["value"] <= 3 + 1
    assert stats["accepted_per_round"] == pytest.approx(20 / 5) and stats["tau_counts"] == "delivered"
    md = markdown(_two_budget_summary({"vat": {"none": {"sb": stats}}}, ["vat"], [0]))
    assert "3.400 [" in md and "(4.000 accepted+1)" in md


# ---- config -------------------------------------------------------------------------------------------------------


def test_a_record_keeps_every_per_prompt_count_by_column():
    from vat.bench.record import compact_eval, from_columns, per_prompt, to_columns

    offload = {"24": {"h2d_bytes": 195747840.0, "hits": 9715.0, "modeled_seconds": 0.0036},
               "32": {"h2d_bytes": 78225408.0, "hits": 11245.0, "modeled_seconds": 0.0017}}
    prompts = [{"question_id": 81, "rounds": 27, "kept": 126, "expert_bytes": 730497024.0,
                "quality": {"matches": 80.0, "kl_sum": 0.0727}, "offload": offload},
               {"question_id": "HumanEval/0", "rounds": 18, "kept": 63, "expert_bytes": 1.5, "output_hash": "ab",
                "offload": {"24": {"h2d_bytes": 3.0, "hits": 1.0, "modeled_seconds": 0.5}}}]
    columns = to_columns(prompts)
    assert columns["expert_bytes"] == [730497024, 1.5] and to_columns([{"s": 0.1 + 0.2}])["s"] == [0.3] and columns["quality"]["kl_sum"] == [0.0727, None]
    assert columns["output_hash"] == [None, "ab"]
    # the offload counts per cache size are columns too, not one dict per prompt
    assert columns["offload"]["24"]["h2d_bytes"] == [195747840, 3] and columns["offload"]["32"]["hits"] == [11245, None]
    assert from_columns(columns) == prompts
    assert from_columns(json.loads(json.dumps(columns))) == prompts
    # the first record layout (a nested dict flattened one level into ``a.b`` columns) still reads
    first_layout = {"question_id": [81, "HumanEval/0"], "quality.kl_sum": [0.0727, None],
                    "offload.24": [offload["24"], None]}
    assert from_columns(first_layout) == [{"question_id": 81, "quality": {"kl_sum": 0.0727}, "offload": {"24": offload["24"]}},
                                          {"question_id": "HumanEval/0"}]
    full = {"settings": {"temperature": 0.0}, "results": {"big": 1}, "pooled": {}, "drafts": {"d": {}},
            "per_prompt": {"d": {"none": {"spec_bench": prompts}}}}
    compact = compact_eval(full)
    assert "results" not in compact and "pooled" not in compact and "per_prompt" not in compact
    assert per_prompt(compact) == full["per_prompt"] and compact["settings"] == full["settings"]
    assert per_prompt({"settings": {}}) is None
    with pytest.raises(KeyError):
        compact_eval({"settings": {}})


def test_a_record_refuses_a_summary_rendered_with_another_config(tmp_path):
    """A shard started before a method was added writes a bench.json without it: --record stops in one line naming
    the difference (rather than ship that bench.json beside a config that has the method), and records once the
    summary matches the config."""
    from omegaconf import OmegaConf

    from vat.bench.record import summary_differs_from_config, write_record

    cfg = load_bench_config(QUICK, [f"output_dir={tmp_path / 'bench'}", "seeds=[0,1]"])
    summary = {"methods": sorted(cfg.methods), "baselines": list(cfg.baselines), "compare": [],
               "reference": cfg.reference, "seeds": [1, 0]}
    assert summary_differs_from_config(summary, cfg) == ""
    assert summary_differs_from_config({k: v for k, v in summary.items() if k != "compare"}, cfg) == ""  # older
    stale = {**summary, "methods": [m for m in cfg.methods if m != "vat"]}
    assert summary_differs_from_config(stale, cfg) == f"methods {stale['methods']} against {sorted(cfg.methods)}"
    os.makedirs(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "bench.json"), "w") as f:
        json.dump(stale, f)
    with pytest.raises(VatError, match=r"rendered with another config \(methods .*--render with --record"):
        write_record(cfg, str(tmp_path / "record"))
    assert not os.path.exists(tmp_path / "record")  # nothing half-written
    with open(os.path.join(cfg.output_dir, "bench.json"), "w") as f:
        json.dump(summary, f)
    with open(os.path.join(cfg.output_dir, "bench_config.yaml"), "w") as f:  # as the last seed shard left it
        f.write(OmegaConf.to_yaml(load_bench_config(QUICK, [f"output_dir={tmp_path / 'bench'}", "seeds=[1]"])))
    assert write_record(cfg, str(tmp_path / "record"))["cells"] == 0
    # the record carries the config its summary was rendered with, so re-reading it renders the same seeds
    assert list(load_bench_config(str(tmp_path / "record" / "bench_config.yaml")).seeds) == [0, 1]
    assert os.path.isfile(tmp_path / "record" / "bench.json")


def test_a_shard_with_another_config_is_told_what_changed(tmp_path):
    """A `--methods` shard launched with other overrides than the run it joins rewrites bench_config.yaml, and the
    summary follows it: the shard is told which keys changed; the same config, a first run, or another bench's config
    in a shared folder say nothing."""
    from omegaconf import OmegaConf

    from vat.bench.config import config_changes

    path = str(tmp_path / "bench_config.yaml")
    first = load_bench_config(QUICK, ["seeds=[0,1]", "eval.limit=20"])
    assert config_changes(path, first) == ""  # no earlier run
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(first))
    assert config_changes(path, load_bench_config(QUICK, ["seeds=[0,1]", "eval.limit=20"])) == ""
    shard = load_bench_config(QUICK, ["seeds=[0,1]", "eval.limit=40", "methods.extra.recipe=tiny/eagle3.yaml"])
    assert config_changes(path, shard) == "methods.extra added, eval.limit 20 -> 40"
    assert config_changes(path, load_bench_config(QUICK, ["seeds=[0]", "eval.limit=20"])) == "seeds [0, 1] -> [0]"
    assert config_changes(path, load_bench_config(QUICK, ["seeds=[0,1]", "name=other"])) == ""


def test_bench_config_loads_and_names_bad_keys():
    cfg = load_bench_config(QUICK, ["eval.limit=5", "seeds=[3]", "methods.extra.recipe=tiny/eagle3.yaml"])
    assert cfg.eval.limit == 5 and list(cfg.seeds) == [3] and set(cfg.methods) == {"eagle3", "vat", "extra"}
    for override, message in [
        ("eval.limt=3", "did you mean `eval.limit`"),
        ("methods.vat.recipee=x", "did you mean `methods.vat.recipe`"),
        ("reference=eagle", "did you mean `eagle3`"),
        ("compare=[vatt]", "did you mean `vat`"),
        ("baselines=[ngramm]", "did you mean `ngram`"),
        ("eval.limit=abc", "expected int"),
        ("seeds=[]", "at least one seed"),
        ("bootstrap.confidence=1.5", "between 0 and 1"),
    ]:
        with pytest.raises(VatError, match=message):
            load_bench_config(QUICK, [override])


def test_bench_cells_share_data_and_steps(tmp_path):
    from vat.bench.cells import check_same_training, plan_cells

    cfg = load_bench_config(QUICK)
    cells = plan_cells(cfg, str(tmp_path))
    assert [c.name for c in cells] == ["eagle3 seed 0", "vat seed 0", "ngram", "none", "eagle3 seed 1", "vat seed 1"]
    trained = [c for c in cells if c.trained]
    assert {c.train_cfg.train.max_steps for c in trained} == {8}
    assert all(c.train_cfg.train.save_every == 4 and c.train_cfg.train.keep_last == 0 for c in trained)
    assert check_same_training(cells) == []
    with pytest.raises(VatError, match="past"):
        plan_cells(load_bench_config(QUICK, ["curve.steps=[9]"]), str(tmp_path))


def test_bench_continuations_name_their_source_by_seed(tmp_path):
    """`{bench_dir}`/`{seed}` fill a method's init_from per cell; continuations are checked against each other."""
    from vat.bench.cells import check_same_training, config_identity, plan_cells

    source = "train.init_from={bench_dir}/cells/eagle3/seed{seed}/train/final"
    cfg = load_bench_config(QUICK, ["methods.more.recipe=tiny/eagle3_vat.yaml", f"methods.more.overrides=['{source}']"])
    cells = plan_cells(cfg, str(tmp_path))
    more = {c.seed: c.train_cfg for c in cells if c.method == "more"}
    assert {s: m.train.init_from for s, m in more.items()} == {
        s: str(tmp_path / "cells" / "eagle3" / f"seed{s}" / "train" / "final") for s in (0, 1)}
    assert check_same_training(cells) == []  # `more` is a continuation: not compared with the from-scratch methods
    # a key vat added after a bench ran (train.init_from), left unset, keeps that bench's cells valid
    plain = [c.train_cfg for c in cells if c.method == "eagle3"][0]
    assert "init_from" not in config_identity(plain)
    assert "init_from" in config_identity(more[0])


# ---- end to end ---------------------------------------------------------------------------------------------------


def test_quick_bench_end_to_end_and_rerun_skips(tmp_path, capsys, one_thread):
    from vat.bench.cells import plan_cells
    from vat.cli import main as vat_main
    from vat.train.trainer import main as train_main

    out = tmp_path / "bench"
    # a cell whose training was killed after its step-4 checkpoint: the bench resumes it rather than restarting
    killed = plan_cells(load_bench_config(QUICK, [f"output_dir={out}"]), str(out))[0]
    killed.train_cfg.train.stop_after = 4
    killed.train_cfg.logging.progress = False
    train_main(killed.train_cfg)
    assert not (out / "cells" / "eagle3" / "seed0" / "train" / "final").exists()

    # `--train-only`: the drafts train (the killed one resumes) and nothing is evaluated; the full run reuses them
    assert vat_main(["bench", QUICK, f"output_dir={out}", "--train-only", "--methods", "eagle3"]) == 0
    assert capsys.readouterr().out.count("not evaluated (--train-only)") == 2
    for seed in (0, 1):
        cell = out / "cells" / "eagle3" / f"seed{seed}"
        assert (cell / "train" / "final" / "config.yaml").exists()
        assert not (cell / "cell.json").exists() and not (cell / "eval").exists()
    assert not (out / "cells" / "ngram").exists() and not (out / "cells" / "vat").exists()

    assert vat_main(["bench", QUICK, f"output_dir={out}"]) == 0
    first = capsys.readouterr().out
    assert first.count("reused draft") == 2  # the eagle3 drafts, trained above
    summary = json.loads((out / "bench.json").read_text())
    assert summary["progress"] == {"cells_done": 6, "cells_total": 6, "complete": True}
    assert summary["benchmarks"] == ["spec_bench", "humaneval"]
    for label in ("eagle3", "vat", "ngram", "none"):
        for bench in summary["benchmarks"]:
            stats = summary["results"][label]["none"][bench]
            tau = stats["tau"]
            assert 1.0 <= tau["low"] <= tau["value"] <= tau["high"], (label, bench, tau)
            ratio = stats["ratio"]
            assert ratio["low"] <= ratio["value"] <= ratio["high"], (label, bench, ratio)
            assert stats["n_prompts"] == 3
            if label in ("eagle3", "vat"):
                assert stats["seeds"] == [0, 1] and set(stats["per_seed"]) == {"0", "1"}
                versus = stats["versus"]["ngram"]  # what a trained draft must beat: the free n-gram lookup
                assert versus["low"] <= versus["value"] <= versus["high"], (label, bench, versus)
                ngram = summary["results"]["ngram"]["none"][bench]["tau"]["value"]
                assert versus["value"] == pytest.approx(tau["value"] / ngram)
    assert summary["results"]["eagle3"]["none"]["spec_bench"]["ratio"]["reference"] is True
    assert summary["results"]["none"]["none"]["spec_bench"]["tau"]["value"] == pytest.approx(1.0)
    assert summary["train"]["vat"]["drafts"] == 2 and summary["train"]["vat"]["minutes_per_draft"] > 0
    resumed = summary["cells"]["eagle3"]["seed0"]["train"]
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 8
    assert [p["step"] for p in summary["curve"]["eagle3"]] == [4]
    assert summary["curve"]["eagle3"][0]["tokens"] > 0
    report = (out / "bench.md").read_text()
    assert "| method | τ [95 % CI] | ratio to eagle3 [95 % CI] | ratio to ngram [95 % CI] | seeds | train min/draft |" in report
    assert "## τ against training tokens" in report
    for png in ("tau_by_benchmark.png", "tau_vs_tokens.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert first.count("[vat bench ") == 6 and "about" in first and "min left" in first
    # checkpoints the curve does not read are pruned once a draft is final
    assert sorted(os.listdir(out / "cells" / "vat" / "seed1" / "train" / "checkpoints")) == ["step_4"]

    def cell_files() -> dict[str, int]:  # every file a cell wrote, with its modification time
        return {str(p): p.stat().st_mtime_ns for p in (out / "cells").rglob("*") if p.is_file()}

    before = cell_files()
    assert vat_main(["bench", QUICK, f"output_dir={out}"]) == 0
    rerun = capsys.readouterr().out
    assert rerun.count("finished earlier, skipped") == 6
    assert cell_files() == before  # nothing trained, evaluated or rewritten again (no timing assertion)
    assert json.loads((out / "bench.json").read_text())["results"] == summary["results"]

    # `compare`: every method is also paired, seed by seed, with another method (no cell reruns)
    assert vat_main(["bench", QUICK, f"output_dir={out}", "compare=[vat]"]) == 0
    assert capsys.readouterr().out.count("finished earlier, skipped") == 6
    compared = json.loads((out / "bench.json").read_text())["results"]
    for bench in summary["benchmarks"]:
        versus = compared["eagle3"]["none"][bench]["versus"]["vat"]
        vat_tau = summary["results"]["vat"]["none"][bench]["tau"]["value"]
        eagle_tau = summary["results"]["eagle3"]["none"][bench]["tau"]["value"]
        assert versus["seeds"] == [0, 1] and versus["low"] <= versus["value"] <= versus["high"]
        assert versus["value"] == pytest.approx(eagle_tau / vat_tau)
        assert "vat" not in compared["vat"]["none"][bench]["versus"]  # never against itself
    assert "| ratio to ngram [95 % CI] | ratio to vat [95 % CI] |" in (out / "bench.md").read_text()

    # `--methods`: only the named methods' and baselines' cells run (a bench sharded by method); the tables still
    # cover every finished cell. A name the bench lacks stops at once with the closest one.
    assert vat_main(["bench", QUICK, f"output_dir={out}", "--methods", "vat,ngram"]) == 0
    sharded = capsys.readouterr().out
    assert sharded.count("finished earlier, skipped") == 3 and "[vat bench 2/3] ngram: finished earlier" in sharded
    assert "eagle3 seed" not in sharded.split("cells ->", 1)[1]
    assert json.loads((out / "bench.json").read_text())["progress"]["cells_done"] == 6
    assert vat_main(["bench", QUICK, f"output_dir={out}", "--methods", "vatt"]) == 2
    assert "did you mean `vat`" in capsys.readouterr().err

    # a record of an earlier vat (another fingerprint) counts when the draft's saved config and the evaluations'
    # settings are the ones wanted now; it then takes the current fingerprint. A draft trained otherwise does not.
    from vat.bench.cells import cell_fingerprint, finished

    bench_cfg = load_bench_config(QUICK, [f"output_dir={out}"])
    cells = plan_cells(bench_cfg, str(out))
    target = summary["target"]
    record_path = out / "cells" / "vat" / "seed1" / "cell.json"
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({**record, "fingerprint": "from-an-earlier-vat"}))
    cell = next(c for c in cells if c.name == "vat seed 1")
    wanted = cell_fingerprint(bench_cfg, cell, target)
    assert finished(cell, wanted) is None  # without the files' evidence: not finished
    assert finished(cell, wanted, bench_cfg, target)["fingerprint"] == wanted
    assert json.loads(record_path.read_text())["fingerprint"] == wanted  # migrated
    record_path.write_text(json.dumps({**record, "fingerprint": "from-an-earlier-vat"}))
    other = load_bench_config(QUICK, [f"output_dir={out}", "methods.vat.overrides=[train.lr=0.5]"])
    cell = next(c for c in plan_cells(other, str(out)) if c.name == "vat seed 1")
    assert finished(cell, cell_fingerprint(other, cell, target), other, target) is None

    # the bench's record: small, no drafts or checkpoints, and it renders the same tables as the bench it records
    rec = tmp_path / "record"
    assert vat_main(["bench", QUICK, f"output_dir={out}", "--record", str(rec)]) == 0
    assert "record of 6 cells" in capsys.readouterr().out
    kept = [p for p in rec.rglob("*") if p.is_file()]
    assert not [p for p in kept if p.suffix in (".safetensors", ".pt", ".jsonl")]
    assert not list(rec.rglob("curve"))  # a curve point's τ is in cell.json
    size = sum(p.stat().st_size for p in kept)
    assert size < sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 10
    assert vat_main(["bench", str(rec / "bench_config.yaml"), f"output_dir={rec}", "--render"]) == 0
    assert (rec / "bench.md").read_text() == (out / "bench.md").read_text()
    assert json.loads((rec / "bench.json").read_text())["results"] == json.loads((out / "bench.json").read_text())["results"]
    assert vat_main(["bench", QUICK, f"output_dir={out}", "--record", str(out)]) == 2  # never over its own output
    assert "that is the bench's own output" in capsys.readouterr().err
    # a render whose config names fewer seeds than the folder has finished says which it leaves out
    assert vat_main(["bench", str(rec / "bench_config.yaml"), f"output_dir={rec}", "seeds=[1]", "--render"]) == 0
    assert "finished cells of seeds [0] are not in this config's seeds [1]" in capsys.readouterr().out


def _two_budget_summary(stats: dict, methods: list[str], seeds: list[int]) -> dict:
    """The bench.json fields ``markdown`` reads, for ``stats`` of benchmark `sb` at natural routing and B = 2."""
    return {"reference": "vat", "progress": {"complete": True, "cells_done": 2, "cells_total": 2},
            "interval": {"confidence": 0.95, "kind": "percentile bootstrap", "samples": 100, "resampled": "x"},
            "settings": {"eval": {"limit": 2, "max_new_tokens": 8, "steps": 3, "temperature": 0.0}},
            "name": "t", "target": "tiny", "seeds": seeds, "methods": methods, "baselines": [], "compare": [],
            "budgets": ["none", "2"], "benchmarks": ["sb"], "results": stats, "train": {}, "curve": {}}


def test_budgeted_rows_carry_quality_pooled_over_seeds_and_prompts(tmp_path):
    """Two seeds' eval.json with per-prompt quality counts at B = 2: bench.json pools them (Σ matches / Σ compared,
    Σ KL / Σ tokens) beside τ, and bench.md shows agreement and KL only in the budgeted table."""
    from types import SimpleNamespace

    from vat.bench.cells import Cell
    from vat.bench.summary import markdown, method_statistics, per_prompt_table

    def prompt(qid, committed, rounds, matches, compared, kl_sum, kl_count):
        q = {"matches": matches, "compared": compared, "first_divergence": matches, "turns": 1,
             "identical": int(matches == compared), "kl_sum": kl_sum, "kl_count": kl_count,
             "step_matches": compared - 1, "step_compared": compared, "step_turns": 1}
        return {"question_id": qid, "committed": committed, "rounds": rounds, "quality": q}

    cells = []
    for seed, (m0, m1, kl) in enumerate(((4, 2, 0.3), (3, 5, 0.1))):
        cell = Cell("vat", seed, str(tmp_path / f"seed{seed}"))
        os.makedirs(os.path.join(cell.directory, "eval"))
        natural = [{"question_id": q, "committed": 6, "rounds": 3} for q in ("a", "b")]
        budgeted = [prompt("a", 5, 3, m0, 5, kl, 5), prompt("b", 4, 3, m1, 5, 2 * kl, 5)]
        with open(os.path.join(cell.directory, "eval", "eval.json"), "w") as f:
            json.dump({"settings": {"temperature": 0.0},
                       "per_prompt": {"vat": {"none": {"sb": natural}, "2": {"sb": budgeted}}}}, f)
        cells.append(cell)
    rows = per_prompt_table(cells)
    boot = SimpleNamespace(samples=200, seed=0, confidence=0.95)
    stats = method_statistics(rows, ["vat"], "vat", boot)
    q = stats["vat"]["2"]["sb"]["quality"]
    assert q["agreement"] == pytest.approx((4 + 2 + 3 + 5) / 20)
    assert q["kl_to_natural"] == pytest.approx((0.3 + 0.6 + 0.1 + 0.2) / 20)
    assert q["first_divergence"] == pytest.approx(14 / 4) and q["turns"] == 4
    assert q["stepwise_agreement"] == pytest.approx(16 / 20)  # one of 5 tokens off per prompt and seed
    assert "quality" not in stats["vat"]["none"]["sb"]
    # a third seed from an older eval (no quality counts): no pooled figure rather than one over two of three seeds
    older = Cell("vat", 2, str(tmp_path / "seed2"))
    os.makedirs(os.path.join(older.directory, "eval"))
    with open(os.path.join(older.directory, "eval", "eval.json"), "w") as f:
        json.dump({"settings": {"temperature": 0.0}, "per_prompt": {"vat": {
            "none": {"sb": [{"question_id": q, "committed": 6, "rounds": 3} for q in ("a", "b")]},
            "2": {"sb": [{"question_id": q, "committed": 5, "rounds": 3} for q in ("a", "b")]}}}}, f)
    three = method_statistics(per_prompt_table([*cells, older]), ["vat"], "vat", boot)["vat"]["2"]["sb"]
    assert three["seeds"] == [0, 1, 2] and three["quality"] is None
    md = markdown(_two_budget_summary(stats, ["vat"], [0, 1]))
    natural_table, budget_table = md.split("## sb, expert budget B = 2")
    assert "agreement" not in natural_table.split("## sb")[1]
    assert "| agreement | stepwise agreement | KL to natural |" in budget_table
    assert "70.0 % | 80.0 % | 0.0600 |" in budget_table


def test_a_budgeted_ratio_to_a_reference_evaluated_only_at_natural_routing_is_marked(tmp_path):
    """The reference `vat` ran at natural routing only, `union` at natural and B = 2: union's B = 2 ratio is its
    budgeted τ over vat's natural τ (the fallback), bench.json says so in ``reference_budget`` and bench.md marks the
    cell; union's natural ratio and vat's own row are unmarked."""
    from types import SimpleNamespace

    from vat.bench.cells import Cell
    from vat.bench.summary import NO_BUDGET, markdown, method_statistics, per_prompt_table

    def write(label, seed, per_budget):
        cell = Cell(label, seed, str(tmp_path / label / f"seed{seed}"))
        os.makedirs(os.path.join(cell.directory, "eval"))
        per_prompt = {b: {"sb": [{"question_id": q, "committed": c, "rounds": 4} for q, c in zip("ab", counts)]}
                      for b, counts in per_budget.items()}
        with open(os.path.join(cell.directory, "eval", "eval.json"), "w") as f:
            json.dump({"settings": {"temperature": 0.0}, "per_prompt": {label: per_prompt}}, f)
        return cell

    cells = [write("vat", 0, {"none": (8, 8)}), write("union", 0, {"none": (10, 10), "2": (6, 6)})]
    rows = per_prompt_table(cells)
    boot = SimpleNamespace(samples=100, seed=0, confidence=0.95)
    stats = method_statistics(rows, ["vat", "union"], "vat", boot)
    budgeted = stats["union"]["2"]["sb"]["ratio"]
    assert budgeted["value"] == pytest.approx(6 / 8) and budgeted["reference_budget"] == NO_BUDGET
    assert stats["union"]["none"]["sb"]["ratio"]["value"] == pytest.approx(10 / 8)
    assert stats["union"]["none"]["sb"]["ratio"]["reference_budget"] == NO_BUDGET
    md = markdown(_two_budget_summary(stats, ["vat", "union"], [0]))
    natural_table, budget_table = md.split("## sb, expert budget B = 2")
    assert "else at natural routing (marked †)" in natural_table
    assert "| union | 2.500 [2.500, 2.500] | 1.250 [1.250, 1.250] | 1 |" in natural_table
    assert "| union | 1.500 [1.500, 1.500] | not measured (older eval: rerun) | – | – | 0.750 [0.750, 0.750] † | 1 |" \
        in budget_table


def test_the_best_free_draft_is_picked_per_benchmark_and_shown_by_name():
    from vat.bench.summary import best_free_drafts, markdown

    def stats(tau, versus=None):
        return {"tau": {"value": tau, "low": tau, "high": tau}, "seeds": [0] if versus else [], "per_seed": {},
                "ratio": None, "n_prompts": 2, **({"versus": versus} if versus else {})}

    est = lambda v: {"value": v, "low": v, "high": v}  # noqa: E731
    results = {
        "vat": {"none": {"sb": stats(3.0, {"ngram-vllm-1-3": est(1.5), "suffix": est(1.2), "ngram-recent-1-3": est(2.0)}),
                         "he": stats(3.0, {"ngram-vllm-1-3": est(1.1), "suffix": est(1.4), "ngram-recent-1-3": est(2.0)})}},
        "ngram-vllm-1-3": {"none": {"sb": stats(2.0), "he": stats(2.7)}},
        "suffix": {"none": {"sb": stats(2.5), "he": stats(2.1)}},
        "ngram-recent-1-3": {"none": {"sb": stats(1.5), "he": stats(1.5)}},
        "none": {"none": {"sb": stats(1.0), "he": stats(1.0)}},
    }
    baselines = ["ngram-vllm-1-3", "suffix", "ngram-recent-1-3", "none"]
    best = best_free_drafts(results, baselines)
    assert best == {"none": {"sb": "suffix", "he": "ngram-vllm-1-3"}}  # AR is never the free draft
    summary = _two_budget_summary(results, ["vat"], [0])
    summary.update(budgets=["none"], benchmarks=["sb", "he"], baselines=baselines, best_free=best)
    md = markdown(summary)
    sb, he = md.split("## he")
    assert "ratio to suffix (best free)" in sb and "1.200 [1.200, 1.200]" in sb and "ngram-recent-1-3 [" not in sb
    assert "ratio to ngram-vllm-1-3 (best free)" in he and "1.100 [1.100, 1.100]" in he


def test_a_saturation_curve_ends_at_the_final_draft_and_says_where_it_passes_the_free_draft(tmp_path):
    """Per-benchmark curve statistics over seeds, the final evaluation appended as the last point only when the
    curve's prompts are the evaluation's, the step where a method's mean τ first reaches the best free draft, and
    the per-benchmark PNG."""
    from vat.bench.plots import plot_curve_by_benchmark
    from vat.bench.summary import _curve_lines, curve_statistics

    def cell(seed, sb, he, final):  # τ per benchmark at steps 100 and 200, then the 400-step final evaluation
        curve = [{"step": s, "tokens": s * 10.0, "tau": None if t is None else (t[0] + t[1]) / 2,
                  "tau_per_benchmark": {"sb": t[0], "he": t[1]}} for s, t in ((100, (sb[0], he[0])),
                                                                             (200, (sb[1], he[1])))]
        return {"seed": seed, "curve": curve, "train": {"steps": 400, "tokens": 4000.0},
                "eval": {"tau": {"sb": final[0], "he": final[1]}}}

    records = {"eagle3": [cell(0, (1.2, 1.6), (1.3, 1.9), (2.1, 2.4)), cell(1, (1.4, 1.8), (1.5, 2.1), (2.3, 2.6))],
               "vat": [cell(0, (1.5, 2.0), (1.5, 2.0), (2.4, 2.8))]}
    curve = curve_statistics(records, final_on_curve=True)
    assert [p["step"] for p in curve["eagle3"]] == [100, 200, 400]
    last = curve["eagle3"][-1]
    assert last["tokens"] == 4000.0 and last["tau_mean"] is None  # cell.json keeps no pooled τ of the final
    assert last["per_benchmark"]["sb"] == pytest.approx({"mean": 2.2, "min": 2.1, "max": 2.3})
    assert curve["eagle3"][1]["per_benchmark"]["he"] == pytest.approx({"mean": 2.0, "min": 1.9, "max": 2.1})
    assert curve["eagle3"][0]["tau_mean"] == pytest.approx((1.25 + 1.45) / 2)
    assert [p["step"] for p in curve_statistics(records)["eagle3"]] == [100, 200]  # other prompts: not on the curve

    est = lambda v: {"value": v, "low": v, "high": v}  # noqa: E731
    summary = {"curve": curve, "benchmarks": ["sb", "he"], "best_free": {"none": {"sb": "suffix", "he": "suffix"}},
               "curve_on_eval_prompts": True,
               "results": {"suffix": {"none": {"sb": {"tau": est(1.9)}, "he": {"tau": est(2.5)}}}}}
    text = "\n".join(_curve_lines(summary))
    assert "| eagle3 | 400 | 4,000 | – | – | 2.200 | 2.500 | 2 |" in text
    assert "- sb: best free draft `suffix`, τ 1.900; reached by eagle3 at step 400, vat at step 200." in text
    assert "- he: best free draft `suffix`, τ 2.500; reached by eagle3 at step 400, vat at step 400." in text
    records["vat"][0]["eval"]["tau"]["he"] = 2.4
    summary["curve"] = curve_statistics(records, final_on_curve=True)
    assert "vat not within the curve" in "\n".join(_curve_lines(summary))
    summary["curve_on_eval_prompts"] = False  # a curve on a prompt subset is not compared with the free drafts
    assert "best free draft" not in "\n".join(_curve_lines(summary))
    summary["curve_on_eval_prompts"] = True
    png = plot_curve_by_benchmark(summary, str(tmp_path / "curve.png"))
    assert open(png, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benches_sharing_their_cells_report_apart(tmp_path):
    from vat.bench.run import report_dir

    out = str(tmp_path)
    assert report_dir(out, "tiny") == out  # an empty output directory is the bench's own
    (tmp_path / "bench_config.yaml").write_text("name: tiny\nseeds: [0]\n")
    assert report_dir(out, "tiny") == out
    assert report_dir(out, "tiny-import") == os.path.join(out, "benches", "tiny-import")


def test_greedy_cells_are_checked_against_autoregressive_outputs(tmp_path):
    """Output hashes per prompt: a greedy natural-routing cell equal to AR on 1 of 2 prompts reads 1/2, NOT lossless."""
    from types import SimpleNamespace

    from vat.bench.cells import Cell
    from vat.bench.summary import markdown, method_statistics, per_prompt_table

    def write(label, seed, hashes):
        cell = Cell(label, seed, str(tmp_path / label / str(seed)))
        os.makedirs(os.path.join(cell.directory, "eval"))
        prompts = [{"question_id": q, "committed": 6, "kept": 6, "rounds": 3, "output_hash": h}
                   for q, h in zip("ab", hashes)]
        with open(os.path.join(cell.directory, "eval", "eval.json"), "w") as f:
            json.dump({"settings": {"temperature": 0.0}, "per_prompt": {label: {"none": {"sb": prompts}}}}, f)
        return cell

    cells = [write("vat", 0, ["x", "y"]), write("eagle3", 0, ["x", "z"]), write("none", None, ["x", "y"])]
    boot = SimpleNamespace(samples=50, seed=0, confidence=0.95)
    stats = method_statistics(per_prompt_table(cells), ["vat", "eagle3", "none"], "vat", boot)
    assert stats["vat"]["none"]["sb"]["lossless"] == {"identical": 2, "compared": 2}
    assert stats["eagle3"]["none"]["sb"]["lossless"] == {"identical": 1, "compared": 2}
    summary = _two_budget_summary(stats, ["vat", "eagle3"], [0])
    summary.update(budgets=["none"], baselines=["none"])
    assert "NOT lossless: vat 2/2, eagle3 1/2." in markdown(summary)


def test_cells_priced_under_offload_get_h2d_per_token_and_ratios_to_the_reference(tmp_path):
    """Two seeds of a reference and a method priced at C = 4 (hand-made counts): bench.json pools H2D bytes per
    delivered token and the hit rate over seeds and prompts, pairs the method with the reference seed by seed on H2D
    per token and on the modeled speed-up under offload, and bench.md gives a row per method and C plus AR's."""
    from types import SimpleNamespace

    from vat.bench.cells import Cell
    from vat.bench.summary import MIB, markdown, method_statistics, per_prompt_table

    def prompt(qid, kept, h2d, hits, seconds):
        counts = {"h2d_bytes": h2d * MIB, "hits": hits, "executed": 10, "ar_h2d_bytes": 2 * MIB, "ar_hits": 9,
                  "ar_executed": 10, "modeled_seconds": seconds, "modeled_ar_seconds": 1.0}
        return {"question_id": qid, "committed": kept, "kept": kept, "rounds": 2, "offload": {"4": counts}}

    def write(label, seed, rows):
        cell = Cell(label, seed, str(tmp_path / label / str(seed)))
        os.makedirs(os.path.join(cell.directory, "eval"))
        with open(os.path.join(cell.directory, "eval", "eval.json"), "w") as f:
            json.dump({"settings": {"temperature": 0.0, "offload": [4]},
                       "per_prompt": {label: {"none": {"sb": [prompt(*r) for r in rows]}}}}, f)
        return cell

    # tree: 8 MiB over 4 tokens per prompt; acc: seed 0 moves half the tree's bytes per token, seed 1 a quarter
    cells = [write("tree", s, [("a", 4, 8, 5, 2.0), ("b", 4, 8, 5, 2.0)]) for s in (0, 1)]
    cells += [write("acc", 0, [("a", 4, 4, 8, 1.0), ("b", 4, 4, 8, 1.0)]),
              write("acc", 1, [("a", 8, 4, 6, 0.5), ("b", 8, 4, 6, 0.5)])]
    boot = SimpleNamespace(samples=200, seed=0, confidence=0.95)
    stats = method_statistics(per_prompt_table(cells), ["tree", "acc"], "tree", boot)
    tree, acc = stats["tree"]["none"]["sb"]["offload"]["4"], stats["acc"]["none"]["sb"]["offload"]["4"]
    assert tree["h2d_mib_per_token"]["value"] == pytest.approx(2.0)
    assert acc["h2d_mib_per_token"]["value"] == pytest.approx(16 / 24)  # Σ bytes / Σ tokens, not a mean of ratios
    assert acc["per_seed_h2d_mib_per_token"] == pytest.approx({"0": 1.0, "1": 0.5})
    assert acc["hit_rate"] == pytest.approx(28 / 40) and acc["ar_hit_rate"] == pytest.approx(0.9)
    assert acc["ar_h2d_mib_per_token"] == pytest.approx(8 / 24)
    assert acc["modeled_speedup"]["value"] == pytest.approx(4 / 3)
    assert acc["h2d_ratio"]["per_seed"] == pytest.approx({"0": 0.5, "1": 0.25})
    assert acc["h2d_ratio"]["t"]["value"] == pytest.approx(0.375)
    assert acc["modeled_ratio"]["per_seed"] == pytest.approx({"0": 2.0, "1": 4.0})
    assert "h2d_ratio" not in tree  # the reference itself
    summary = _two_budget_summary(stats, ["tree", "acc"], [0, 1])
    summary.update(budgets=["none"], reference="tree")
    summary["settings"]["eval"].update(offload_policy="lru", offload_link="pcie5")
    md = markdown(summary).split("## Under expert offload")[1]
    assert "| AR (the reference's tokens) | 4 | 90.0 % | 0.500 | – | 1 | – | – |" in md
    assert "| tree | 4 | 50.0 % | 2.000 [2.000, 2.000] | 1 (reference) | 0.500 [0.500, 0.500] | 1 (reference) |" in md
    assert "| acc | 4 | 70.0 % | 0.667 [" in md and "(0.50 / 0.25)" in md and "| 1.000 / 0.500 |" in md


# ---- shards writing one record --------------------------------------------------------------------------------------


def _write_many(path: str, text: str, times: int) -> None:
    from vat.export.checkpoint import write_text_atomic

    for _ in range(times):
        write_text_atomic(path, text)


def test_shards_writing_one_file_at_once_leave_one_whole_file(tmp_path):
    """Two shards of a bench write bench_config.yaml / bench.json / bench.md into one directory. With one temporary
    name shared by both, their writes interleaved into a file neither wrote (a torn bench_config.yaml stopped a render);
    each writer now has its own temporary file, so what is left is always one writer's whole text."""
    import multiprocessing

    path = str(tmp_path / "bench_config.yaml")
    long_text, short_text = "a: 1\n" * 4000, "b: 2\n" * 10
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_many, args=(path, text, 200)) for text in (long_text, short_text)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    with open(path) as f:
        assert f.read() in (long_text, short_text)
    assert os.listdir(tmp_path) == ["bench_config.yaml"]  # no temporary file left behind
