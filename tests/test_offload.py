"""The expert-offloading model (vat/eval/offload.py): the residency caches against traces simulated by hand, the H2D
bytes of real tiny decodes against their recorded trace, C = E against the plain cost model, and bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import olmoe_with_eagle3_drafts

import vat.eval.run as run_module
from vat.bench.cells import eval_settings
from vat.bench.config import load_bench_config
from vat.cli import main as cli_main
from vat.errors import VatError
from vat.eval.config import check_eval_config, eval_config
from vat.eval.engine import SpeculativeEngine
from vat.eval.offload import HOST_LINKS, LayerCaches, OffloadSpec, ResidencyCache, input_sets
from vat.eval.run import run_eval
from vat.eval.tree import TreeSpec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lru_against_a_trace_simulated_by_hand():
    # one layer, C = 3, 10 bytes per expert. The hand simulation (resident set after each forward, [last forward]):
    #   f1 {0,1}:     two free fills                                   -> {0[1], 1[1]}            hits 0 loads 0
    #   f2 {1,2}:     1 hit; 2 fills the last free slot                -> {0[1], 1[2], 2[2]}      hits 1 loads 0
    #   f3 {3}:       full; the oldest is 0 (f1): out                  -> {1[2], 2[2], 3[3]}      hits 0 loads 1
    #   f4 {0,1}:     1 hit; 0 in, the oldest other than 1 is 2 (f2)   -> {1[4], 3[3], 0[4]}      hits 1 loads 1
    #   f5 {2,3,4}:   3 hit; 2 in: oldest of {0,1} (both f4) by id: 0  -> {1[4], 3[5], 2[5]}
    #                 4 in: the only expert not in f5 is 1: out        -> {3[5], 2[5], 4[5]}      hits 1 loads 2
    #   f6 {0,1,2,3}: union 4 > C; 2, 3 hit; 0 in: 4 out (not in f6)  -> {3[6], 2[6], 0[6]}
    #                 1 in: all resident are in f6: lowest id 0 out    -> {3, 2, 1}               hits 2 loads 2
    trace = [[0, 1], [1, 2], [3], [1, 0], [4, 3, 2], [3, 2, 1, 0]]
    expected = [(0, 0, 2), (1, 0, 1), (0, 1, 0), (1, 1, 0), (1, 2, 0), (2, 2, 0)]  # (hits, loads, fills)
    cache = ResidencyCache(3, "lru")
    got = [cache.access(forward) for forward in trace]
    assert [(a.hits, a.loads, a.fills) for a in got] == expected
    assert cache.resident == {1, 2, 3}
    # the same trace as one layer of LayerCaches: H2D = 6 loads x 10 bytes; 5 hits of 14 executed experts
    layer = LayerCaches(3, "lru", [10])
    totals = [layer.access([forward]) for forward in trace]
    assert tuple(sum(t[i] for t in totals) for i in range(3)) == (60.0, 5, 14)


def test_lfu_keeps_the_expert_used_most_where_lru_drops_it():
    # C = 2. f1 {0} fill, f2 {0} hit (0 used twice), f3 {1} fill (cache full), f4 {2}: LRU evicts 0 (last used f2 <
    # f3), LFU evicts 1 (used once < twice); f5 {0}: an LFU hit, an LRU load (evicting 1, last used f3 < f4)
    trace = [[0], [0], [1], [2], [0]]
    lru, lfu = ResidencyCache(2, "lru"), ResidencyCache(2, "lfu")
    lru_got = [(a.hits, a.loads, a.fills) for a in map(lru.access, trace)]
    lfu_got = [(a.hits, a.loads, a.fills) for a in map(lfu.access, trace)]
    assert lru_got == [(0, 0, 1), (1, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 0)]
    assert lfu_got == [(0, 0, 1), (1, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)]
    assert lru.resident == {0, 2} and lfu.resident == {0, 2}


def test_two_layers_price_loads_with_their_own_expert_bytes():
    # layer 0 (C = 2, 100 bytes): {0,1} fills, {2} loads (evicts 0); layer 1 (200 bytes): {5} fill, {5,6} fill + hit
    caches = LayerCaches(2, "lru", [100, 200])
    assert caches.access([[0, 1], [5]]) == (0.0, 0, 3)
    assert caches.access([[2], [5, 6]]) == (100.0, 1, 3)


@pytest.mark.parametrize("settings,message", [
    (dict(offload="8", offload_policy="fifo", cost_model="h200"), "--offload-policy `fifo`: one of lru, lfu"),
    (dict(offload="8", offload_link="nvlink", cost_model="h200"), "--offload-link `nvlink`: one of pcie5, c2c"),
    (dict(offload="eight", cost_model="h200"), "--offload takes a comma list of resident experts per layer"),
    (dict(offload="0", cost_model="h200"), "--offload: resident experts per layer must be >= 1, got 0"),
    (dict(offload="8"), "--offload adds host-to-device time to the modeled forwards: add --cost-model"),
    (dict(offload_policy="lfu"), "--offload-policy / --offload-link set the offload model: add --offload"),
])
def test_bad_offload_settings_are_one_line(settings, message):
    with pytest.raises(VatError) as err:
        check_eval_config(eval_config(**settings))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_cache_smaller_than_top_k_is_refused():
    with pytest.raises(VatError, match=r"^--offload 1: resident experts per layer must be between the target's "
                                       r"top_k \(2\) and its experts per layer \(8\)$"):
        OffloadSpec.parse("1,4").check(num_experts=8, top_k=2)
    with pytest.raises(VatError, match="unknown residency policy `mru`"):
        ResidencyCache(4, "mru")


def test_cli_refuses_c_below_k_before_decoding(saved_target_and_draft, spec_bench_file, capsys):
    root, target_dir, _ = saved_target_and_draft
    rc = cli_main(["eval", "--target", target_dir, "--draft", "ngram", "--benchmark", spec_bench_file, "--limit", "1",
                   "--max-new-tokens", "4", "--output", str(root / "bad_offload"), "--cost-model", "h200",
                   "--offload", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the target's loading bar: one line
    assert rc == 2 and err == ("vat: error: --offload 1: resident experts per layer must be between the target's "
                               "top_k (2) and its experts per layer (8)")


def _replay(result_runs_entries, capacity, expert_bytes, num_experts):
    """H2D bytes per prompt from the recorded trace, replayed here forward by forward (decode, then its AR)."""
    decode, ar = LayerCaches(capacity, "lru", expert_bytes), LayerCaches(capacity, "lru", expert_bytes)
    out = []
    for run in result_runs_entries:
        d = a = 0.0
        for gen in run.turns:
            for r in gen.rounds:
                d += decode.access(r.expert_sets)[0]
                for pos in range(r.committed):
                    a += ar.access(input_sets(r.input_experts, pos, num_experts))[0]
        out.append((d, a))
    return out


def test_offload_of_real_tiny_decodes(saved_target_and_draft, spec_bench_file, monkeypatch):
    root, target_dir, draft_dir = saved_target_and_draft
    passes = []  # each pass's decoded runs, as run_eval hands them to the offload model
    original = run_module.add_offload

    def spy(spec, cost, runs, metrics, entries, num_experts):
        passes.append(list(runs))
        return original(spec, cost, runs, metrics, entries, num_experts)

    monkeypatch.setattr(run_module, "add_offload", spy)
    result = run_eval(target=target_dir, drafts=[draft_dir, "ngram"], benchmarks=[spec_bench_file], limit=2,
                      max_new_tokens=16, steps=3, cost_model="h200", offload="2,8", output=str(root / "offload"),
                      progress=False, plots=False)
    bench = result["benchmarks"][0]
    assert result["offload"]["capacities"] == [2, 8] and result["offload"]["link_bytes_per_s"] == 64e9
    assert result["settings"]["offload"] == [2, 8] and result["settings"]["offload_policy"] == "lru"
    shape = result["cost_model"]["target_shape"]
    expert_bytes = [e * result["cost_model"]["served_bytes"] for e in shape["expert_params"]]
    labels = list(result["per_prompt"])
    assert len(passes) == len(labels) == 3  # AR, the draft, ngram: one pass each, in order
    for label, runs in zip(labels, passes):
        entries = result["per_prompt"][label]["none"][bench]
        for r in (r for run in runs for g in run.turns for r in g.rounds):  # the recorded sets are the union
            assert [len(s) for s in r.expert_sets] == r.union
        # the H2D bytes eval.json reports are the trace's, replayed here forward by forward
        want = _replay(runs, 2, expert_bytes, 8)
        got = [(e["offload"]["2"]["h2d_bytes"], e["offload"]["2"]["ar_h2d_bytes"]) for e in entries]
        assert got == want
        metrics = result["results"][label]["none"][bench]
        kept = sum(e["kept"] for e in entries)
        assert metrics["offload"]["2"]["h2d_bytes_per_token"] == pytest.approx(sum(w[0] for w in want) / kept)
        # seconds under offload = the bytes model's + H2D bytes over PCIe 5
        for e in entries:
            assert e["offload"]["2"]["modeled_seconds"] == pytest.approx(
                e["modeled_seconds"] + e["offload"]["2"]["h2d_bytes"] / HOST_LINKS["pcie5"].bytes_per_s)
        # C = E: everything resident (the caches start warm), nothing crosses the link, the cost model's speed-up
        full = metrics["offload"]["8"]
        assert full["h2d_bytes"] == 0 and full["ar_h2d_bytes_per_token"] == 0 and full["hit_rate"] < 1
        assert full["modeled_offload_speedup_vs_ar"] == pytest.approx(metrics["cost"]["modeled_speedup_vs_ar"])
    ar = result["results"]["none"]["none"][bench]["offload"]
    assert ar["2"]["modeled_offload_speedup_vs_ar"] == pytest.approx(1.0) and ar["2"]["h2d_bytes_per_token"] > 0
    # greedy decoding is lossless, so a draft's AR baseline replays the AR pass's own trace: the same H2D bytes
    ar_entries = result["per_prompt"]["none"]["none"][bench]
    for label in labels[1:]:
        entries = result["per_prompt"][label]["none"][bench]
        assert [e["offload"]["2"]["ar_h2d_bytes"] for e in entries] == [
            e["offload"]["2"]["h2d_bytes"] for e in ar_entries]
    report = open(root / "offload" / "report.md").read()
    assert "### Expert offloading" in report and "H2D MiB/token" in report and "bytes model" in report


def _inputs(gen) -> torch.Tensor:
    """(tokens fed, L', k) executed ids of every kept input position of a decode, in order."""
    return torch.cat([r.input_experts[: r.committed] for r in gen.rounds])


@pytest.mark.parametrize("tree", [None, TreeSpec(3, 4, 10)], ids=["chain", "tree"])
def test_the_recorded_trace_of_chain_and_tree_rounds(tree):
    model, target, drafts, prompts = olmoe_with_eagle3_drafts(torch.Generator().manual_seed(1234))
    try:
        ar = SpeculativeEngine(target, None, max_new_tokens=20, record_experts=True).generate(prompts[1])
        spec = SpeculativeEngine(target, drafts["rigged"], steps=4, tree=tree, max_new_tokens=20,
                                 record_experts=True).generate(prompts[1])
        assert spec.token_ids == ar.token_ids and any(r.accepted > 1 for r in spec.rounds)
        # the accepted path's positions executed what AR's one-token forwards of the same tokens executed
        assert torch.equal(_inputs(spec), _inputs(ar))
        for r in spec.rounds:
            assert [len(s) for s in r.expert_sets] == r.union and r.input_experts.shape[0] == r.accepted + 1
        # a budgeted tree round: its sets stay inside B, its kept inputs use them only
        budgeted = SpeculativeEngine(target, drafts["rigged"], steps=4, tree=tree, budget=3, max_new_tokens=20,
                                     record_experts=True).generate(prompts[1])
        for r in budgeted.rounds:
            assert all(len(s) <= 3 for s in r.expert_sets) and r.union == [len(s) for s in r.expert_sets]
            for pos in range(r.accepted + 1):
                assert all(set(ids) <= set(s) for ids, s in zip(input_sets(r.input_experts, pos, 8), r.expert_sets))
    finally:
        target.close()


def test_a_bench_passes_offload_through_its_eval_section():
    base = ["methods.a.recipe=tiny/eagle3.yaml", "reference=a"]
    bench = load_bench_config(None, [*base, "eval.cost_model=h200", "eval.offload='4,6'", "eval.offload_link=c2c"])
    settings = eval_settings(bench, method="a")  # what every cell's run_eval gets
    assert (settings["offload"], settings["offload_link"], settings["cost_model"]) == ("4,6", "c2c", "h200")
    assert "offload_policy" not in settings  # at its default: left out, as every variant (finished cells stay)
    assert "offload" not in eval_settings(load_bench_config(None, base), method="a")
    with pytest.raises(VatError, match=r"bench config key `eval.offload_policy`: one of lru, lfu"):
        load_bench_config(None, [*base, "eval.offload=4", "eval.cost_model=h200", "eval.offload_policy=fifo"])
    with pytest.raises(VatError, match=r"`eval.offload`: it prices forwards on the cost model: set eval.cost_model"):
        load_bench_config(None, [*base, "eval.offload=4"])


def test_a_bench_passes_acceptmoe_commitment_and_residency_per_method():
    """A method's eval override carries AcceptMoE's p̂ file (its placeholders filled per cell) and residency C, so
    a bench runs the paper's offload system beside the plain one; both stay out of the other methods' settings."""
    from vat.bench.cells import cell_eval_settings, plan_cells

    over = ["methods.a.recipe=tiny/eagle3.yaml", "reference=a", "methods.b.draft='{bench_dir}/cells/a/seed{seed}/x'",
            "methods.b.eval.policy=acceptmoe", "methods.b.eval.budgets=[auto]",
            "methods.b.eval.commitment='{bench_dir}/cells/a/seed{seed}/eval/eval.json'",
            "methods.b.eval.acceptmoe_residency=4", "eval.cost_model=h200", "eval.offload='4,6'", "output_dir=/tmp/b"]
    bench = load_bench_config(None, over)
    assert eval_settings(bench, method="b")["acceptmoe_residency"] == 4
    assert "commitment" not in eval_settings(bench, method="a") and "acceptmoe_residency" not in eval_settings(
        bench, method="a")
    cell = next(c for c in plan_cells(bench, "/tmp/b") if c.method == "b" and c.seed == 1)
    assert cell_eval_settings(bench, cell)["commitment"] == "/tmp/b/cells/a/seed1/eval/eval.json"


def test_a_bench_passes_ecospec_predictor_and_lambda_per_method():
    """EcoSpec's expert predictor (a `vat prep expert-probe` file fitted per seed's draft) and λ as a method's eval
    overrides: the path's placeholders are filled per cell, both reach `run_eval` as EvalConfig fields, and a method
    without them keeps settings (and finished cells) as before."""
    import dataclasses

    from vat.bench.cells import EVAL_VARIANT_DEFAULTS, cell_eval_settings, plan_cells
    from vat.eval.config import EvalConfig

    over = ["methods.a.recipe=tiny/eagle3.yaml", "reference=a", "methods.b.draft='{bench_dir}/cells/a/seed{seed}/x'",
            "methods.b.eval.tree='4,6,16'", "methods.b.eval.tree_policy=ecospec", "methods.b.eval.ecospec_lambda=0.5",
            "methods.b.eval.affinity='{bench_dir}/probes/seed{seed}.safetensors'", "output_dir=/tmp/b"]
    bench = load_bench_config(None, over)
    assert "affinity" not in eval_settings(bench, method="a") and "ecospec_lambda" not in eval_settings(bench, method="a")
    assert eval_settings(bench, method="b")["ecospec_lambda"] == 0.5
    cell = next(c for c in plan_cells(bench, "/tmp/b") if c.method == "b" and c.seed == 2)
    assert cell_eval_settings(bench, cell)["affinity"] == "/tmp/b/probes/seed2.safetensors"
    fields = {f.name for f in dataclasses.fields(EvalConfig)}
    assert {"affinity", "ecospec_lambda"} <= set(EVAL_VARIANT_DEFAULTS) <= fields


def test_a_refitted_predictor_under_the_same_path_runs_the_cell_again(tmp_path):
    """A cell is keyed by the contents of the files its evaluation reads (EcoSpec's probe, AcceptMoE's p̂), not by
    their paths: refitting the probe in place changes the cell's fingerprint, rewriting the same bytes does not,
    and a method that reads no such file keeps the fingerprint it had without one."""
    from vat.bench.cells import cell_fingerprint, plan_cells

    out = str(tmp_path / "b")
    over = ["methods.a.recipe=tiny/eagle3.yaml", "reference=a", "methods.b.draft='{bench_dir}/cells/a/seed{seed}/x'",
            "methods.b.eval.tree='4,6,16'", "methods.b.eval.tree_policy=ecospec",
            "methods.b.eval.affinity='{bench_dir}/probes/seed{seed}.safetensors'", f"output_dir={out}", "seeds=[0]"]
    bench = load_bench_config(None, over)
    cells = {c.method: c for c in plan_cells(bench, out)}
    probe = tmp_path / "b" / "probes" / "seed0.safetensors"
    probe.parent.mkdir(parents=True)

    def fingerprint(method):
        return cell_fingerprint(bench, cells[method], "/t")

    missing = fingerprint("b")
    probe.write_bytes(b"first fit")
    first = fingerprint("b")
    probe.write_bytes(b"first fit")
    assert fingerprint("b") == first != missing
    probe.write_bytes(b"refitted")
    assert fingerprint("b") != first
    plain = fingerprint("a")
    probe.write_bytes(b"again")
    assert fingerprint("a") == plain
