"""Quality under an expert budget (docs/eval.md): the metrics on hand-computed cases, the KL equal to `vat profile`'s,
and `vat eval` on the quick tiny target writing them for every budgeted row."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vat.eval.quality import (
    add_counts,
    empty_counts,
    response_kl,
    sequence_agreement,
    stepwise_agreement,
    summarize_quality,
)
from vat.target import BudgetSpec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_agreement_and_first_divergence_by_hand():
    assert sequence_agreement([1, 2, 3, 4], [1, 2, 5, 4]) == {"matches": 3, "compared": 4, "first_divergence": 2,
                                                               "identical": 0}
    # a prefix: the missing tail counts as disagreement, the divergence is where the shorter one ends
    assert sequence_agreement([7, 8], [7, 8, 9]) == {"matches": 2, "compared": 3, "first_divergence": 2,
                                                     "identical": 0}
    assert sequence_agreement([5, 6, 7], [5, 6, 7]) == {"matches": 3, "compared": 3, "first_divergence": 3,
                                                        "identical": 1}
    assert sequence_agreement([9], [1, 9]) == {"matches": 0, "compared": 2, "first_divergence": 0, "identical": 0}
    # pooled over turns: Σ matches / Σ compared (3+2+3+0) / (4+3+3+2), first divergence (2+2+3+0) / 4
    total = empty_counts()
    for out, ref in (([1, 2, 3, 4], [1, 2, 5, 4]), ([7, 8], [7, 8, 9]), ([5, 6, 7], [5, 6, 7]), ([9], [1, 9])):
        add_counts(total, {**sequence_agreement(out, ref), "turns": 1, "kl_sum": 0.5, "kl_count": 2})
    q = summarize_quality(total, greedy=True, reference="x")
    assert q["agreement"] == pytest.approx(8 / 12) and q["first_divergence"] == pytest.approx(7 / 4)
    assert q["identical_turns"] == 0.25 and q["kl_to_natural"] == pytest.approx(2.0 / 8) and q["turns"] == 4
    sampled = summarize_quality(total, greedy=False)
    assert sampled["agreement"] is None and sampled["first_divergence"] is None
    assert sampled["kl_to_natural"] == pytest.approx(0.25)  # the KL needs no greedy output


@pytest.fixture(scope="module")
def quick():
    from vat.target import load_target
    from vat.target.model import resolve_target_path

    path = resolve_target_path("tiny-quick")
    return path, load_target(path, dtype="float32", device="cpu", experts_impl="eager")


def test_response_kl_is_the_profile_kl(quick):
    """With no prompt the response KL is `vat profile`'s figure over the same windows; a prompt prefilled naturally
    leaves the KL of the positions after it and a budget of E experts gives exactly 0."""
    from vat.profile import profile_target

    _, target = quick
    ids = torch.randint(10, target.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    prof = profile_target(target, [ids], window=5, budget=2, progress=False)
    got = response_kl(target, [], ids, {(b, 5): BudgetSpec(B=b, policy="substitute", window=5)
                                        for b in (2, target.num_experts)})
    kl_sum, n = got[(2, 5)]
    assert n == 40 and kl_sum / n == pytest.approx(prof["kl_to_unbudgeted"], rel=1e-5) and kl_sum > 0
    assert got[(target.num_experts, 5)] == (0.0, 40)
    # a natural prompt in front: its positions are not counted and not budgeted
    prompt, resp = ids[:25], ids[25:]
    kl_sum2, n2 = response_kl(target, prompt, resp, {(2, 5): BudgetSpec(B=2, policy="substitute", window=5)})[(2, 5)]
    assert n2 == 15 and kl_sum2 > 0


def test_stepwise_agreement_against_one_forward_per_position(quick):
    """The natural greedy choice after each prefix of an output, from one forward per position (the obvious slow
    way), against the one teacher-forced forward: on the target's own greedy continuation every token matches; after
    a token swapped in, the count is what the slow loop finds, and the pooled figure needs every turn's counts."""
    _, target = quick
    prompt = torch.randint(10, target.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()

    def natural_choice(prefix):  # one full natural forward, no cache
        ids = torch.tensor([prefix], device=target.device)
        return int(target.forward(ids, output_aux=False, capture_routing=False).logits[0, -1].argmax())

    greedy = []
    for _ in range(10):
        greedy.append(natural_choice(prompt + greedy))
    assert stepwise_agreement(target, prompt, greedy) == {"step_matches": 10, "step_compared": 10, "step_turns": 1}
    swapped = greedy[:4] + [(greedy[4] + 1) % target.vocab_size] + greedy[5:]
    slow = sum(natural_choice(prompt + swapped[:i]) == swapped[i] for i in range(len(swapped)))
    got = stepwise_agreement(target, prompt, swapped)
    assert got == {"step_matches": slow, "step_compared": 10, "step_turns": 1} and 4 <= slow <= 9
    assert stepwise_agreement(target, prompt, []) == {"step_matches": 0, "step_compared": 0, "step_turns": 1}

    total = empty_counts()
    add_counts(total, {**sequence_agreement(swapped, greedy), "turns": 1, **got})
    assert summarize_quality(total, greedy=True)["stepwise_agreement"] == pytest.approx(slow / 10)
    assert summarize_quality(total, greedy=False)["stepwise_agreement"] is None
    add_counts(total, {**sequence_agreement(greedy, greedy), "turns": 1})  # an older eval's turn: no step counts
    assert summarize_quality(total, greedy=True)["stepwise_agreement"] is None


def test_eval_writes_quality_for_every_budgeted_row(quick, spec_bench_file, tmp_path):
    """The quick tiny target, the n-gram draft (nothing to train) at budgets none and 2: the natural reference is the
    AR pass; agreement and divergence recomputed from generations.jsonl; report.md shows the columns. Without the AR
    pass and without `none`, one extra natural greedy pass gives the same reference."""
    from chosen_prompts import choose_prompts

    from vat.eval.run import run_eval

    path, target = quick
    out = str(tmp_path / "q")
    decode = dict(target=target, tokenizer=path, max_new_tokens=12, steps=3)
    # a prompt whose answer B = 2 changes on this build of the target (so the figures are not all trivially 1),
    # and one as it comes
    questions = choose_prompts(spec_bench_file, "ngram", lambda e: e["quality"]["matches"] < e["quality"]["compared"],
                               str(tmp_path / "picked.jsonl"), pool=16, budget=2, **decode)
    ev = run_eval(drafts=["ngram"], benchmarks=[questions], limit=2, budgets="none,2", output=out, progress=False,
                  plots=False, **decode)
    bench = ev["benchmarks"][0]
    assert "lossless" in ev["quality_reference"][bench]["source"]
    q = ev["results"]["ngram"]["2"][bench]["quality"]
    assert "quality" not in ev["results"]["ngram"]["none"][bench] and "quality" not in ev["results"]["none"]["none"][bench]
    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = {(r["question_id"], r["draft"], r["budget"]): r["token_ids"] for r in map(json.loads, f)}
    matches = compared = first = turns = 0
    for (qid, draft, budget), tok in rows.items():
        if (draft, budget) != ("ngram", "2"):
            continue
        for out_ids, ref_ids in zip(tok, rows[(qid, "none", "none")]):
            n = min(len(out_ids), len(ref_ids))
            same = [a == b for a, b in zip(out_ids[:n], ref_ids[:n])]
            matches += sum(same)
            compared += max(len(out_ids), len(ref_ids))
            first += next((i for i, s in enumerate(same) if not s), n)
            turns += 1
    assert q["agreement"] == pytest.approx(matches / compared) and q["first_divergence"] == pytest.approx(first / turns)
    assert q["turns"] == turns and q["kl_tokens"] > 0 and q["kl_to_natural"] > 0 and q["agreement"] < 1.0
    per = ev["per_prompt"]["ngram"]["2"][bench]
    assert sum(p["quality"]["matches"] for p in per) == matches
    # stepwise: every output token is compared; up to the first divergence the prefix is the natural greedy one, so
    # at least those tokens are the natural choice
    generated = sum(len(o) for (_, d, b), tok in rows.items() if (d, b) == ("ngram", "2") for o in tok)
    assert sum(p["quality"]["step_compared"] for p in per) == generated
    assert first <= sum(p["quality"]["step_matches"] for p in per) <= generated
    assert q["stepwise_agreement"] == pytest.approx(sum(p["quality"]["step_matches"] for p in per) / generated)
    assert ev["pooled"]["ngram"]["2"]["quality"]["agreement"] == pytest.approx(q["agreement"])
    report = open(os.path.join(out, "report.md")).read()
    assert "| agreement | 1st divergence | stepwise agreement | KL to natural |" in report and f"{100 * q['agreement']:.1f} %" in report

    # an eval.json from before the stepwise agreement: scripts/backfill_stepwise.py renders each turn's prompt from
    # generations.jsonl's text and finds the same counts the evaluation took from its own prompts
    import importlib.util

    from transformers import AutoTokenizer

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "backfill_stepwise.py")
    spec = importlib.util.spec_from_file_location("backfill_stepwise", script)
    backfill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backfill)
    with open(os.path.join(out, "eval.json")) as f:
        older = json.load(f)
    for entry in older["per_prompt"]["ngram"]["2"][bench]:
        for key in ("step_matches", "step_compared", "step_turns"):
            del entry["quality"][key]
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(older, f)
    assert backfill.backfill(out, target=target, tokenizer=AutoTokenizer.from_pretrained(path))
    with open(os.path.join(out, "eval.json")) as f:
        mended = json.load(f)
    assert mended["results"]["ngram"]["2"][bench]["quality"]["stepwise_agreement"] == q["stepwise_agreement"]
    assert mended["pooled"]["ngram"]["2"]["quality"]["stepwise_agreement"] == q["stepwise_agreement"]
    assert mended["per_prompt"]["ngram"]["2"][bench] == per
    assert not backfill.backfill(out, target=target, tokenizer=None)  # nothing left to add: the target is not loaded

    again = run_eval(drafts=["ngram"], benchmarks=[questions], limit=2, budgets="2", progress=False, plots=False,
                     autoregressive=False, **decode)
    assert "extra AR pass" in again["quality_reference"][bench]["source"]
    q2 = again["results"]["ngram"]["2"][bench]["quality"]
    for key in ("agreement", "first_divergence", "stepwise_agreement", "kl_to_natural"):
        assert q2[key] == pytest.approx(q[key], rel=1e-9), key


def test_reference_cache_stands_in_for_the_extra_ar_pass(quick, spec_bench_file, tmp_path):
    """A greedy run at natural routing fills the cache with the target's own greedy output (the AR pass's tokens);
    a later budget-only run reads it instead of decoding again and gets the quality figures of the extra AR pass;
    another token limit is another key; a damaged file is decoded again and rewritten."""
    from vat.eval.run import run_eval

    path, target = quick
    cache = str(tmp_path / "natural")
    kw = dict(target=target, benchmarks=[spec_bench_file], limit=2, steps=3, progress=False, plots=False,
              tokenizer=path)
    first = run_eval(drafts=["ngram"], budgets="none", max_new_tokens=12, reference_cache=cache,
                     output=str(tmp_path / "ar"), **kw)  # the AR pass and ngram at none: no budget, no quality
    bench = first["benchmarks"][0]
    (file,) = [os.path.join(cache, f) for f in os.listdir(cache)]
    with open(os.path.join(tmp_path / "ar", "generations.jsonl")) as f:
        ar = {r["question_id"]: r["token_ids"] for r in map(json.loads, f) if r["draft"] == "none"}
    with open(file) as f:
        stored = {p["question_id"]: p["token_ids"] for p in json.load(f)["prompts"]}
    assert stored == ar and len(stored) == 2

    cached = run_eval(drafts=["ngram"], budgets="2", max_new_tokens=12, reference_cache=cache, autoregressive=False,
                      **kw)
    assert cached["quality_reference"][bench]["source"].startswith("natural greedy decode (cached")
    assert cached["quality_reference"][bench]["seconds"] == 0.0
    decoded = run_eval(drafts=["ngram"], budgets="2", max_new_tokens=12, autoregressive=False, **kw)
    assert "extra AR pass" in decoded["quality_reference"][bench]["source"]
    q, q_ref = (r["results"]["ngram"]["2"][bench]["quality"] for r in (cached, decoded))
    for key in ("agreement", "first_divergence", "kl_to_natural", "turns"):
        assert q[key] == pytest.approx(q_ref[key], rel=1e-12), key

    longer = run_eval(drafts=["ngram"], budgets="2", max_new_tokens=16, reference_cache=cache, autoregressive=False,
                      **kw)
    assert "extra AR pass" in longer["quality_reference"][bench]["source"] and len(os.listdir(cache)) == 2
    with open(file, "w") as f:
        f.write('{"prompts": [{"question_id"')  # a run killed mid-write by hand
    again = run_eval(drafts=["ngram"], budgets="2", max_new_tokens=12, reference_cache=cache, autoregressive=False,
                     **kw)
    assert "extra AR pass" in again["quality_reference"][bench]["source"]
    with open(file) as f:
        assert {p["question_id"]: p["token_ids"] for p in json.load(f)["prompts"]} == ar


def test_quality_against_a_reference_target(quick, spec_bench_file, tmp_path):
    """`--reference-target`: every pass, natural routing included, is compared with another model's natural greedy
    output (what a Window Pool target is judged against: its base). Two tiny random targets with one tokenizer: the
    reference's output is the AR pass of an eval on the reference itself; agreement is recounted from both
    generations files; KL at natural routing is KL(evaluated ‖ reference) from two plain forwards; the target as
    its own reference gives agreement 1 and KL 0 at natural routing; another vocabulary stops in one line."""
    from tiny_models import save_tiny_target

    from vat.errors import VatError
    from vat.eval.run import run_eval
    from vat.target import load_target

    base = save_tiny_target(str(tmp_path / "base"), "olmoe", seed=0)
    other = save_tiny_target(str(tmp_path / "other"), "olmoe", seed=1)
    kw = dict(benchmarks=[spec_bench_file], limit=2, steps=3, max_new_tokens=10, progress=False, plots=False,
              dtype="float32", device="cpu")
    run_eval(target=base, drafts=["none"], output=str(tmp_path / "ar_base"), **kw)
    cache = str(tmp_path / "natural")
    ev = run_eval(target=other, drafts=["ngram"], budgets="none,2", reference_target=base, reference_cache=cache,
                  output=str(tmp_path / "other_vs_base"), **kw)
    bench = ev["benchmarks"][0]
    assert ev["settings"]["reference_target"] == base and "reference target" in ev["quality_reference"][bench]["source"]

    def generations(name):
        with open(tmp_path / name / "generations.jsonl") as f:
            return {(r["question_id"], r["draft"], r["budget"]): r["token_ids"] for r in map(json.loads, f)}

    reference = {q: t for (q, d, _), t in generations("ar_base").items() if d == "none"}
    for (qid, draft, budget), turns in generations("other_vs_base").items():
        matches = compared = 0
        for out_ids, ref_ids in zip(turns, reference[qid]):
            matches += sum(a == b for a, b in zip(out_ids, ref_ids))
            compared += max(len(out_ids), len(ref_ids))
        (entry,) = [p for p in ev["per_prompt"][draft][budget][bench] if p["question_id"] == qid]
        assert (entry["quality"]["matches"], entry["quality"]["compared"]) == (matches, compared), (draft, budget)
    assert ev["results"]["none"]["none"][bench]["quality"]["agreement"] < 1.0  # another model: other answers

    # KL at natural routing on the reference's own text (the cache keeps its prompts): two plain forwards
    (file,) = os.listdir(cache)
    with open(os.path.join(cache, file)) as f:
        stored = json.load(f)["prompts"]
    models = [load_target(p, dtype="float32", device="cpu", experts_impl="eager").model for p in (other, base)]
    kl_sum = kl_count = 0.0
    for prompt in stored:
        for prompt_ids, response in zip(prompt["prompt_ids"], prompt["token_ids"]):
            ids = torch.tensor([prompt_ids + response])
            with torch.no_grad():
                p, q = (torch.log_softmax(m(ids).logits[0, len(prompt_ids):].double(), -1) for m in models)
            kl_sum += float((p.exp() * (p - q)).sum())
            kl_count += len(response)
    assert ev["results"]["ngram"]["none"][bench]["quality"]["kl_to_natural"] == pytest.approx(kl_sum / kl_count,
                                                                                               rel=1e-4)

    itself = run_eval(target=other, drafts=["ngram"], budgets="none,2", reference_target=other, **kw)
    own = run_eval(target=other, drafts=["ngram"], budgets="none,2", **kw)
    natural = itself["results"]["ngram"]["none"][bench]["quality"]
    assert natural["agreement"] == 1.0 and natural["kl_to_natural"] == 0.0 and natural["stepwise_agreement"] == 1.0
    for key in ("agreement", "first_divergence", "stepwise_agreement", "kl_to_natural"):
        got, want = (r["results"]["ngram"]["2"][bench]["quality"][key] for r in (itself, own))
        assert got == pytest.approx(want, rel=1e-9), key
    with pytest.raises(VatError, match="vocabulary"):
        run_eval(target=other, drafts=["ngram"], reference_target=quick[0], **kw)
