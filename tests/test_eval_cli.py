"""`vat eval` end to end on a saved tiny target and a saved draft: every output file, every eval.json key, the
lossless multi-turn generations, budgets in the recorded unions, and the one-line user errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vat.cli import main as cli_main
from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.eval.run import run_eval
from vat.export.checkpoint import save_draft

METRIC_KEYS = {
    "tau", "accept_by_position", "union_per_round", "expert_bytes_per_token", "tokens_per_s", "speedup_vs_ar",
    "n_prompts", "n_rounds", "target_forwards_per_token", "categories",
}
PLOTS = ("tau_by_benchmark.png", "accept_by_position.png", "union_vs_tau.png")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_cli_smoke_writes_every_output(saved_target_and_draft, spec_bench_file):
    root, target_dir, draft_dir = saved_target_and_draft
    out = str(root / "out")
    rc = cli_main([
        "eval", "--target", target_dir, "--draft", draft_dir, "--draft", "none", "--benchmark", spec_bench_file,
        "--limit", "2", "--max-new-tokens", "16", "--budget", "none,2", "--output", out,
    ])
    assert rc == 0
    for name in ("eval.json", "generations.jsonl", "report.md", *PLOTS):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    for name in PLOTS:
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    with open(os.path.join(out, "eval.json")) as f:
        ev = json.load(f)
    bench = ev["benchmarks"][0]
    assert ev["benchmarks"] == ["spec_bench"]
    assert set(ev["results"]) == {"none", "run/final"}
    assert set(ev["results"]["run/final"]) == {"none", "2"} and set(ev["results"]["none"]) == {"none"}
    for draft, per_budget in ev["results"].items():
        for budget, per_bench in per_budget.items():
            m = per_bench[bench]
            assert METRIC_KEYS <= set(m), (draft, budget, METRIC_KEYS - set(m))
            assert m["n_prompts"] == 2 and m["n_rounds"] > 0 and m["tau"] >= 1.0
            assert m["speedup_vs_ar"] > 0 and m["tokens_per_s"] > 0 and m["expert_bytes_per_token"] > 0
            assert {"mean", "p50", "p90", "p99", "max", "histogram", "per_layer"} <= set(m["union_per_round"])
            assert len(m["categories"]) >= 1
            for cat in m["categories"].values():
                assert METRIC_KEYS - {"categories"} <= set(cat)
            assert sum(cat["n_prompts"] for cat in m["categories"].values()) == 2
    ar = ev["results"]["none"]["none"][bench]
    assert ar["tau"] == 1.0 and ar["speedup_vs_ar"] == pytest.approx(1.0)
    assert ar["union_per_round"]["max"] == ev["target_info"]["top_k"]
    assert ev["results"]["run/final"]["2"][bench]["union_per_round"]["max"] <= 2
    assert ev["results"]["run/final"]["none"][bench]["union_per_round"]["max"] > 2
    assert ev["pooled"]["run/final"]["none"]["n_prompts"] == 2
    assert len(ev["results"]["run/final"]["none"][bench]["accept_by_position"]["conditional"]) == 7

    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2 * 3  # prompts x (AR + draft x 2 budgets)
    for row in rows:
        assert {"question_id", "draft", "budget", "temperature", "token_ids", "text"} <= set(row)
        assert len(row["token_ids"]) == 2 == len(row["text"])  # MT-Bench rows have two turns
        assert all(1 <= len(t) <= 16 for t in row["token_ids"])
    by_key = {(r["question_id"], r["draft"], r["budget"]): r["token_ids"] for r in rows}
    for qid in {r["question_id"] for r in rows}:  # greedy, unbudgeted: the draft changes nothing, turn 2 included
        assert by_key[(qid, "run/final", "none")] == by_key[(qid, "none", "none")]

    assert set(ev["results"]["none"]["none"][bench]["categories"]) == {r["category"] for r in rows}

    report = open(os.path.join(out, "report.md")).read()
    assert "| draft | budget | τ |" in report and "run/final" in report and "union_vs_tau.png" in report
    # one decoded answer per benchmark: the first prompt (file order) and the AR run's first-turn text
    first = rows[0]
    example = ev["examples"][bench]
    assert (example["draft"], example["budget"]) == ("none", "none") and (first["draft"], first["budget"]) == ("none", "none")
    assert example["answer"] == first["text"][0]
    question = json.loads(open(spec_bench_file).readline())  # Spec-Bench's first question leads the spread
    assert example["question"] == question["turns"][0] and first["question_id"] == question["question_id"]
    assert "Example: the first prompt and the answer of `none` at budget none:" in report
    assert (example["answer"][:50] if "```" not in example["answer"] else "```text") in report


def test_run_eval_finds_the_target_from_the_draft(saved_target_and_draft, spec_bench_file):
    _, target_dir, draft_dir = saved_target_and_draft
    ev = run_eval(drafts=[draft_dir], benchmarks=[spec_bench_file], limit=1, max_new_tokens=4, steps=3,
                  tree="2,2,3", progress=False)
    assert ev["target"] == target_dir and ev["settings"]["tree"] == {"top_k": 2, "depth": 2, "total_tokens": 3}
    assert ev["results"]["run/final"]["none"]["spec_bench"]["n_prompts"] == 1


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "2"], "batch size 1"),
    (["--budget", "none,x"], "--budget"),
    (["--tree", "4,4"], "--tree"),
    (["--vh-threshold", "0.5"], "verification head"),
])
def test_user_errors_are_one_line(saved_target_and_draft, spec_bench_file, capsys, flags, message):
    root, target_dir, draft_dir = saved_target_and_draft
    rc = cli_main(["eval", "--target", target_dir, "--draft", draft_dir, "--benchmark", spec_bench_file,
                   "--limit", "1", "--output", str(root / "bad"), *flags])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: transformers' loading bars
    assert rc == 2 and last.startswith("vat: error:") and message in last


# ---- the n-gram draft and the per-prompt counts ------------------------------------------------------------------


def test_ngram_cli_on_tiny_target_needs_no_trained_draft(saved_target_and_draft, spec_bench_file, monkeypatch):
    """`--target tiny --draft ngram`: the embedded target's name resolves as for any command (the build itself is
    stubbed with the saved tiny target: no training in unit tests)."""
    import vat.data_prep.tiny_target as tiny

    root, target_dir, _ = saved_target_and_draft
    monkeypatch.setattr(tiny, "ensure_tiny_target", lambda size="full": target_dir)
    out = str(root / "ngram_out")
    rc = cli_main([
        "eval", "--target", "tiny", "--draft", "ngram", "--draft", "suffix", "--benchmark", spec_bench_file,
        "--limit", "2", "--max-new-tokens", "12", "--budget", "none,2", "--ngram-n", "2", "--output", out,
    ])
    assert rc == 0
    with open(os.path.join(out, "eval.json")) as f:
        ev = json.load(f)
    assert ev["target"] == target_dir
    assert ev["drafts"]["ngram"] == {"path": None, "mode": "ngram", "free_draft": "ngram", "name": "ngram-vllm-1-2",
                                     "n_max": 2, "n_min": 1, "rule": "vllm", "verification_head": False,
                                     "vh_threshold": None}
    assert ev["drafts"]["suffix"]["free_draft"] == "suffix" and ev["drafts"]["suffix"]["max_depth"] == 24
    assert set(ev["results"]) == {"none", "ngram", "suffix"} and set(ev["results"]["ngram"]) == {"none", "2"}
    assert set(ev["per_prompt"]["ngram"]) == {"none", "2"}
    m = ev["results"]["ngram"]["2"]["spec_bench"]
    assert m["union_per_round"]["max"] <= 2 and m["n_rounds"] > 0
    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    by_key = {(r["question_id"], r["draft"], r["budget"]): r["token_ids"] for r in rows}
    for qid in {r["question_id"] for r in rows}:  # greedy, unbudgeted: prompt lookup and suffix decoding are lossless
        assert by_key[(qid, "ngram", "none")] == by_key[(qid, "none", "none")]
        assert by_key[(qid, "suffix", "none")] == by_key[(qid, "none", "none")]
    report = open(os.path.join(out, "report.md")).read()
    assert "`ngram` (training-free n-gram prompt lookup, vLLM's rule" in report and "| ngram | 2 |" in report
    assert "`suffix` (training-free suffix decoding" in report


@pytest.mark.parametrize("flags,message", [
    ([], "--draft ngram needs --target"),
    (["--target", "TARGET", "--ngram-n", "2", "--ngram-min", "3"], "--ngram-min"),
])
def test_ngram_user_errors_are_one_line(saved_target_and_draft, spec_bench_file, capsys, flags, message):
    root, target_dir, _ = saved_target_and_draft
    flags = [target_dir if f == "TARGET" else f for f in flags]
    rc = cli_main(["eval", "--draft", "ngram", "--benchmark", spec_bench_file, "--limit", "1",
                   "--output", str(root / "bad_ngram"), *flags])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("vat: error:") and message in last


def test_per_prompt_counts_pair_and_reproduce_tau(saved_target_and_draft, spec_bench_file):
    root, target_dir, draft_dir = saved_target_and_draft
    out = str(root / "per_prompt")
    ev = run_eval(target=target_dir, drafts=[("ngram", "ngram"), draft_dir, "none"], benchmarks=[spec_bench_file],
                  limit=3, max_new_tokens=10, steps=3, budgets="none,2", output=out, progress=False, plots=False)
    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    keys = ("rounds", "committed", "kept", "accepted", "drafted", "expert_bytes")
    for row in rows:  # one entry per turn, as token_ids
        assert all(len(row[k]) == len(row["token_ids"]) for k in keys), row
        assert row["kept"] == [len(t) - 1 for t in row["token_ids"]]  # the prefill's token is no round's
        assert all(c == r + a for c, r, a in zip(row["committed"], row["rounds"], row["accepted"]))

    assert set(ev["per_prompt"]) == {"none", "ngram", "run/final"}
    orders = set()
    for label, per_budget in ev["per_prompt"].items():
        for budget, per_bench in per_budget.items():
            pooled = {k: 0 for k in keys}
            for bench, prompts in per_bench.items():
                m = ev["results"][label][budget][bench]
                assert len(prompts) == m["n_prompts"] == 3
                orders.add(tuple(p["question_id"] for p in prompts))
                sums = {k: sum(p[k] for p in prompts) for k in keys}
                assert sums["kept"] / sums["rounds"] == m["tau"] == m["tokens_per_round"]  # exactly the reported τ
                assert sums["committed"] / sums["rounds"] == m["accepted_per_round"] >= m["tau"]
                assert sums["rounds"] == m["n_rounds"]
                assert sums["expert_bytes"] / sums["kept"] == pytest.approx(m["expert_bytes_per_token"], rel=1e-12)
                mine = [r for r in rows if (r["draft"], r["budget"], r["benchmark"]) == (label, budget, bench)]
                assert [r["question_id"] for r in mine] == [p["question_id"] for p in prompts]
                for p, r in zip(prompts, mine):  # the totals are the per-turn lists summed
                    assert all(p[k] == pytest.approx(sum(r[k])) for k in keys) and p["category"] == r["category"]
                for k in keys:
                    pooled[k] += sums[k]
            assert pooled["kept"] / pooled["rounds"] == ev["pooled"][label][budget]["tau"]
    assert len(orders) == 1  # every draft and budget in the same prompt order: runs pair by index
    ar = ev["per_prompt"]["none"]["none"]["spec_bench"]
    assert all(p["committed"] == p["rounds"] and p["drafted"] == 0 for p in ar)
    assert ev["drafts"]["ngram"]["mode"] == "ngram" and ev["drafts"]["run/final"]["mode"] == "chain"


# ---- the experts implementation: selectable, recorded, and the Triton kernel decodes as grouped_mm -------------

def _eval_rows(out: str) -> tuple[dict, dict]:
    with open(os.path.join(out, "eval.json")) as f:
        ev = json.load(f)
    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = {(r["question_id"], r["draft"], r["budget"]): r["token_ids"] for r in map(json.loads, f)}
    return ev, rows


def test_triton_kernel_decodes_like_grouped_mm_under_a_budget(tmp_path, spec_bench_file):
    """`vat eval --experts-impl triton` (Triton interpreter, fp32) on the quick tiny target: the same generations,
    token for token, and the same τ as grouped_mm with B = 4 (k = 4 of 16 experts, so every 4-token verification
    block of the chain draft is really cut), AR and draft alike. One of the two prompts is picked from the build at
    hand so that the n-gram draft gets tokens accepted under the budget: τ equality then covers accepted blocks, not
    only rejections, whatever this machine's build of the target generates."""
    from chosen_prompts import choose_prompts
    from transformers import AutoConfig

    from vat.target.model import resolve_target_path

    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest: kernels run on CPU tensors
    target_dir = resolve_target_path("tiny-quick")  # built once and cached, as for every tiny-quick test
    config = AutoConfig.from_pretrained(target_dir)
    cfg = Eagle3Config.for_target(config, draft_vocab_size=config.vocab_size, target_path=target_dir)
    torch.manual_seed(0)
    draft_dir = save_draft(Eagle3Drafter(cfg), cfg, str(tmp_path / "run" / "final"))
    decode = dict(steps=3, max_new_tokens=12)
    questions = choose_prompts(
        spec_bench_file, "ngram", lambda e: e["accepted"] > 0, str(tmp_path / "picked.jsonl"), budget=4,
        target=target_dir, dtype="float32", device="cpu", experts_impl="grouped_mm", **decode)
    first = json.loads(open(questions).readline())
    runs = {}
    for impl in ("grouped_mm", "triton"):
        out = str(tmp_path / impl)
        rc = cli_main([
            "eval", "--target", "tiny-quick", "--draft", draft_dir, "--draft", "ngram", "--benchmark", questions,
            "--limit", "2", "--max-new-tokens", str(decode["max_new_tokens"]), "--steps", str(decode["steps"]),
            "--budget", "4", "--experts-impl", impl, "--dtype", "float32", "--device", "cpu", "--output", out,
        ])
        assert rc == 0
        runs[impl] = _eval_rows(out)
    (ev_g, rows_g), (ev_t, rows_t) = runs["grouped_mm"], runs["triton"]
    assert ev_g["target_info"]["experts_impl"] == "grouped_mm" and ev_t["target_info"]["experts_impl"] == "triton"
    assert ev_t["target_info"]["dtype"] == "float32" and ev_t["target_info"]["device"] == "cpu"
    assert rows_t == rows_g and len(rows_g) == 2 * 3  # 2 prompts x (AR + 2 drafts under B = 4)
    bench = ev_g["benchmarks"][0]
    for draft, budget in (("none", "none"), ("run/final", "4"), ("ngram", "4")):
        m_g, m_t = ev_g["results"][draft][budget][bench], ev_t["results"][draft][budget][bench]
        assert m_t["tau"] == m_g["tau"] and m_t["n_rounds"] == m_g["n_rounds"]
        assert m_t["union_per_round"] == m_g["union_per_round"]
    # the picked prompt gets n-gram tokens accepted under the budget on both paths
    accepted = {impl: {p["question_id"]: p["accepted"] for p in ev["per_prompt"]["ngram"]["4"][bench]}
                for impl, (ev, _) in runs.items()}
    assert accepted["triton"] == accepted["grouped_mm"] and accepted["triton"][first["question_id"]] > 0
    assert ev_t["results"]["ngram"]["4"][bench]["tau"] > 1.0
    assert ev_g["results"]["run/final"]["4"][bench]["union_per_round"]["max"] == 4  # cut to B


def test_target_loading_flags_reach_the_loader(saved_target_and_draft, spec_bench_file):
    root, target_dir, draft_dir = saved_target_and_draft
    out = str(root / "eager")
    rc = cli_main(["eval", "--target", target_dir, "--draft", draft_dir, "--benchmark", spec_bench_file, "--limit", "1",
                   "--max-new-tokens", "4", "--budget", "2", "--experts-impl", "eager", "--dtype", "bfloat16",
                   "--device", "cpu", "--output", out])
    assert rc == 0
    ev, _ = _eval_rows(out)
    assert ev["target_info"]["experts_impl"] == "eager" and ev["target_info"]["dtype"] == "bfloat16"
    assert ev["target_info"]["device_map"] is None


def test_bad_experts_impl_is_a_usage_error(saved_target_and_draft, spec_bench_file, capsys):
    root, target_dir, _ = saved_target_and_draft
    with pytest.raises(SystemExit):
        cli_main(["eval", "--target", target_dir, "--benchmark", spec_bench_file, "--experts-impl", "fast",
                  "--output", str(root / "bad_impl")])
    assert "--experts-impl: invalid choice: 'fast'" in capsys.readouterr().err
