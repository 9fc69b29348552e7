"""`vat eval --policy acceptmoe` and `--tree-policy ecospec` end to end on the quick tiny target: AcceptMoE runs are
keyed ``auto`` and carry the quality figures of every budgeted run (KL with the same p̂), EcoSpec trees decode the AR
output token for token, the commitment file is read from an eval.json or a list, and bad combinations stop in one
line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from chosen_prompts import choose_prompts
from helpers import make_eagle3_draft

from vat.errors import VatError
from vat.eval.commitment import load_commitment
from vat.eval.config import parse_budgets
from vat.eval.policies import EvalPolicy
from vat.eval.policies.registry import EVAL_POLICIES, policy_help
from vat.eval.quality import response_kl
from vat.eval.run import run_eval
from vat.target.budget import AcceptMoESpec, BudgetSpec

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quick():
    from vat.target import load_target
    from vat.target.model import resolve_target_path

    path = resolve_target_path("tiny-quick")
    target = load_target(path, dtype="float32", device="cpu", experts_impl="eager")
    return path, target, make_eagle3_draft(target.model, target, rigged=True)


def test_parse_budgets_takes_auto():
    assert parse_budgets("none,auto,4,auto") == [None, "auto", 4]


def test_acceptmoe_runs_are_keyed_auto_with_quality(quick, spec_bench_file, tmp_path):
    path, target, draft = quick
    p_hat = tmp_path / "p.json"
    p_hat.write_text(json.dumps([0.6, 0.4, 0.3]))
    ev = run_eval(target=target, drafts=[("d", draft)], benchmarks=[spec_bench_file], limit=2, max_new_tokens=12,
                  steps=3, budgets="none,auto", policy="acceptmoe", commitment=str(p_hat), progress=False,
                  plots=False, tokenizer=path, output=str(tmp_path / "out"))
    bench = ev["benchmarks"][0]
    natural, accept = ev["results"]["d"]["none"][bench], ev["results"]["d"]["auto"][bench]
    assert ev["settings"]["policy"] == "acceptmoe" and ev["settings"]["budgets"] == ["none", "auto"]
    assert ev["drafts"]["d"]["acceptmoe_commitment"] == [0.6, 0.4, 0.3]
    q = accept["quality"]
    assert q["agreement"] is not None and q["kl_tokens"] > 0 and q["kl_to_natural"] > 0
    assert ev["pooled"]["d"]["auto"]["quality"]["kl_to_natural"] == pytest.approx(q["kl_to_natural"])
    assert accept["union_per_round"]["mean"] < natural["union_per_round"]["mean"]  # the set really is cut
    # the KL keys carry p̂: an AcceptMoE-fix set of all E experts is the natural model
    with open(os.path.join(tmp_path / "out", "generations.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r["draft"] == "none"]
    assert rows and "report.md" in os.listdir(tmp_path / "out")
    per = ev["per_prompt"]["d"]["auto"][bench]
    assert sum(p["quality"]["kl_count"] for p in per) == q["kl_tokens"]
    ids = rows[0]["token_ids"][0]
    weighting = AcceptMoESpec(commitment=(0.6, 0.4, 0.3))
    specs = {b: BudgetSpec(B=b, policy="acceptmoe", window=4, acceptmoe=weighting) for b in ("auto", target.num_experts)}
    kl = response_kl(target, [], ids, specs)
    assert kl["auto"][1] == len(ids) and kl[target.num_experts] == (0.0, len(ids))  # |S| = E (AcceptMoE-fix) is natural


def test_ecospec_eval_decodes_the_ar_output(quick, spec_bench_file, tmp_path):
    from safetensors.torch import save_file

    from vat.data_prep.affinity import affinity_from_routing

    path, target, draft = quick
    text = torch.randint(10, target.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    table, _ = affinity_from_routing(text, target.forward(text, output_aux=False).topk_ids, None, target.vocab_size,
                                     target.num_experts)
    affinity = str(tmp_path / "affinity.safetensors")
    save_file({"affinity": table}, affinity, metadata={"indexed_by": "target_id"})
    eco = dict(tree="3,3,8", tree_policy="ecospec", ecospec_lambda=2.0, affinity=affinity, tokenizer=path,
               target=target, max_new_tokens=12)
    # a prompt on which this build of the target accepts some of the rigged draft's tree, and one as it comes
    questions = choose_prompts(spec_bench_file, ("d", draft), lambda e: e["accepted"] > 0,
                               str(tmp_path / "picked.jsonl"), pool=16, **eco)
    out = str(tmp_path / "eco")
    ev = run_eval(drafts=[("d", draft)], benchmarks=[questions], limit=2, progress=False, plots=False, output=out,
                  **eco)
    assert ev["settings"]["tree_policy"] == "ecospec" and ev["settings"]["ecospec_lambda"] == 2.0
    assert ev["drafts"]["d"]["ecospec_affinity"] == affinity
    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = {(r["question_id"], r["draft"]): r["token_ids"] for r in map(json.loads, f)}
    for (qid, label), ids in rows.items():
        if label == "d":
            assert ids == rows[(qid, "none")]  # lossless at T = 0
    assert len(rows) == 4 and ev["results"]["d"]["none"][ev["benchmarks"][0]]["tau"] > 1.0


def test_bad_policy_combinations_are_refused_in_one_line(quick, spec_bench_file, tmp_path):
    path, target, draft = quick
    kw = dict(target=target, drafts=[("d", draft)], benchmarks=[spec_bench_file], limit=1, max_new_tokens=4,
              progress=False, plots=False, tokenizer=path)
    with pytest.raises(VatError, match="needs --policy acceptmoe"):
        run_eval(budgets="auto", **kw)
    with pytest.raises(VatError, match="add --tree"):
        run_eval(tree_policy="ecospec", **kw)
    with pytest.raises(VatError, match="add --policy acceptmoe"):
        run_eval(commitment="x.json", **kw)
    with pytest.raises(VatError, match="has no affinity.safetensors"):
        run_eval(tree="2,2,3", tree_policy="ecospec", **kw)


def test_commitment_from_an_eval_json(tmp_path):
    ev = {"drafts": {"none": {"path": None}, "a": {"path": str(tmp_path / "a")}, "b": {"path": str(tmp_path / "b")}},
          "pooled": {"a": {"none": {"accept_by_position": {"unconditional": [0.7, 0.5]}}},
                     "b": {"none": {"accept_by_position": {"unconditional": [0.9, 0.8, 0.1]}}}}}
    f = tmp_path / "eval.json"
    f.write_text(json.dumps(ev))
    assert load_commitment(str(f), str(tmp_path / "b")) == (0.9, 0.8, 0.1)
    with pytest.raises(VatError, match="none is"):
        load_commitment(str(f), str(tmp_path / "c"))
    del ev["drafts"]["b"]
    f.write_text(json.dumps(ev))
    assert load_commitment(str(f), None) == (0.7, 0.5)  # the only trained draft


class _DepthOne(EvalPolicy):
    """A toy selection policy registered at test time: every trained draft's chain cut to its first token."""

    name = "depth1"
    summary = "every drafted chain cut to depth 1"

    def for_pass(self, draft, budget):
        return self if draft.model is not None and not draft.is_free else None

    def cut_chain(self, draft, context, mode):
        return draft.prefix(1)


def test_a_policy_registered_in_one_line_runs_through_vat_eval(quick, spec_bench_file, tmp_path, monkeypatch):
    """One registry entry is all `vat eval` needs: the name is a choice (config check, --help), the engine cuts every
    round of the draft to one draft token (a chain of 4 otherwise), and greedy decoding still gives AR's output."""
    path, target, draft = quick
    monkeypatch.setitem(EVAL_POLICIES, "depth1", _DepthOne)
    assert "depth1" in policy_help("tree_policy")[0]
    out = str(tmp_path / "depth1")
    ev = run_eval(target=target, drafts=[("d", draft)], benchmarks=[spec_bench_file], limit=2, steps=4,
                  max_new_tokens=12, tree_policy="depth1", tokenizer=path, output=out, progress=False, plots=False)
    assert ev["settings"]["tree_policy"] == "depth1"
    bench = ev["benchmarks"][0]
    entries = ev["per_prompt"]["d"]["none"][bench]
    assert len(entries) == 2 and all(e["drafted"] == e["rounds"] > 0 for e in entries)  # one draft token per round
    assert ev["per_prompt"]["none"]["none"][bench][0]["drafted"] == 0
    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = {(r["question_id"], r["draft"]): r["token_ids"] for r in map(json.loads, f)}
    assert len(rows) == 4 and all(ids == rows[(qid, "none")] for (qid, label), ids in rows.items())  # lossless
    monkeypatch.delitem(EVAL_POLICIES, "depth1")
    with pytest.raises(VatError, match="one of confidence, evict, ecospec"):
        run_eval(target=target, drafts=[("d", draft)], tree_policy="depth1", tokenizer=path, progress=False)
