"""The n-gram (prompt lookup) draft: the incremental index against the obvious scan, the point-mass acceptance rule,
and the engine: lossless greedy decoding, speculation on repetitive text, budgets and sampling, on tiny fp32 targets."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import chi_square, chi_square_critical
from tiny_models import greedy_reference, tiny_model

from vat.errors import VatError
from vat.eval.engine import SpeculativeEngine
from vat.eval.ngram import NgramSpec, PromptLookup, point_mass_q, propose_reference
from vat.eval.sampling import accept_chain_sampling, acceptance_probability, residual_distribution
from vat.target import load_target

NEW_TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the lookup itself ---------------------------------------------------------------------------------------------


def test_propose_examples_vllm_rule():
    spec = NgramSpec(n_max=3, n_min=2)  # vLLM's rule is the default
    # the example of vLLM's NgramProposer.propose: [4, 2, 3] has no match, [2, 3] matches at 1..2, three tokens follow
    assert PromptLookup(spec, [1, 2, 3, 4, 2, 3]).propose(4) == [4, 2, 3]
    # the suffix [2, 3] occurs at 0..1 and 4..5: the earliest occurrence is copied
    assert PromptLookup(NgramSpec(3, 1), [2, 3, 9, 9, 2, 3, 7, 8, 2, 3]).propose(4) == [9, 9, 2, 3]
    # the longest n wins over an earlier shorter match: [1, 2, 3] at 4..6 beats [2, 3] at 0..1
    assert PromptLookup(NgramSpec(3, 1), [2, 3, 0, 0, 1, 2, 3, 5, 1, 2, 3]).propose(2) == [5, 1]
    # a periodic tail: [2, 1, 2] first occurs at 2..4, so the rest of the loop is proposed, not one period
    assert PromptLookup(NgramSpec(3, 1), [7, 1, 2, 1, 2, 1, 2, 1, 2]).propose(6) == [1, 2, 1, 2]
    assert NgramSpec().label == "ngram-vllm-1-3" and NgramSpec(5, 5, "recent").label == "ngram-recent-5-5"
    with pytest.raises(VatError, match="rule"):
        NgramSpec(rule="latest")


def test_propose_examples():
    spec = NgramSpec(n_max=3, n_min=1, rule="recent")
    # the suffix [2, 3] last occurred at 4..5 (not 0..1): the most recent earlier occurrence wins
    assert PromptLookup(spec, [2, 3, 9, 9, 2, 3, 7, 8, 2, 3]).propose(4) == [7, 8, 2, 3]
    # inside a short loop the most recent occurrence gives one period
    assert PromptLookup(spec, [7, 1, 2, 1, 2, 1, 2, 1, 2]).propose(6) == [1, 2]
    assert PromptLookup(spec, [1, 2, 3, 4, 1, 2, 3]).propose(2) == [4, 1]  # n = 3 matches; K caps the proposal
    assert PromptLookup(spec, [1, 2, 3, 4, 1, 2, 3]).propose(9) == [4, 1, 2, 3]  # fewer near the end
    assert PromptLookup(spec, [5, 6, 7]).propose(3) == []  # nothing repeats: an AR round
    assert PromptLookup(spec, [4, 4]).propose(3) == [4]  # the suffix never matches itself
    assert PromptLookup(NgramSpec(3, 2), [8, 1, 5, 1]).propose(3) == []  # a single-token match is below n_min
    assert PromptLookup(spec, [1, 2]).propose(0) == []
    with pytest.raises(VatError, match="ngram"):
        NgramSpec(n_max=2, n_min=3)


@pytest.mark.parametrize("rule", ["vllm", "recent"])
@pytest.mark.parametrize("n_max,n_min", [(1, 1), (2, 1), (3, 1), (3, 2), (4, 4), (5, 2)])
def test_incremental_index_equals_the_reference_scan(n_max, n_min, rule):
    rng = random.Random(n_max * 10 + n_min)
    spec = NgramSpec(n_max=n_max, n_min=n_min, rule=rule)
    for _ in range(30):
        vocab = rng.choice([2, 3, 5, 12])  # small vocabularies repeat often, large ones rarely
        seq = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        lookup = PromptLookup(spec, seq)
        for _ in range(60):
            k = rng.randint(0, 8)
            assert lookup.propose(k) == propose_reference(seq, k, n_max, n_min, rule), (seq, k)
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]  # committed in chunks, as rounds do
            seq += new
            lookup.extend(new)
        assert lookup.tokens == seq


# ---- acceptance with a point-mass proposal ---------------------------------------------------------------------------


def test_point_mass_acceptance_follows_the_formula():
    p = torch.tensor([0.1, 0.5, 0.25, 0.15], dtype=torch.float64)
    d = 2
    q = point_mass_q(torch.tensor([d]), 4, torch.float64)[0]
    assert q.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert acceptance_probability(p, q, d) == pytest.approx(0.25)  # min(1, p(d) / 1) = p(d)
    expected = torch.tensor([0.1, 0.5, 0.0, 0.15], dtype=torch.float64) / 0.75  # p without d, renormalised
    torch.testing.assert_close(residual_distribution(p, q), expected)

    # the sampler: P(accept) = p(d); after a rejection the token follows the residual; overall the token follows p
    gen = torch.Generator().manual_seed(0)
    P = torch.stack([p, p])  # (K + 1, V), K = 1
    n = 10000
    accepted, counts = 0, torch.zeros(4, dtype=torch.float64)
    for _ in range(n):
        a, token = accept_chain_sampling(P, q[None], torch.tensor([d]), gen)
        accepted += a
        counts[d if a else token] += 1
        assert a == 1 or token != d
    assert accepted / n == pytest.approx(0.25, abs=0.015)  # 3.5 standard deviations
    torch.testing.assert_close(counts / n, p, atol=0.015, rtol=0)


# ---- the engine ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("olmoe", seed=2)
    target = load_target(model, device="cpu")
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    yield model, target, prompts
    target.close()


def repetitive_prompt(model, length: int = 12) -> list[int]:
    """A prompt whose greedy continuation the prompt already contains: a seed, then the target's own greedy decode
    of it twice over -- so lookup drafts are the target's own next tokens and get accepted."""
    seed = [7, 19, 42]
    return seed + greedy_reference(model, seed, length) + seed


@pytest.mark.parametrize("steps,spec", [(1, NgramSpec()), (4, NgramSpec()), (7, NgramSpec(5, 2))])
def test_greedy_ngram_decoding_is_lossless(setup, steps, spec):
    model, target, prompts = setup
    accepted = 0
    for prompt in [*prompts, repetitive_prompt(model)]:
        engine = SpeculativeEngine(target, spec, steps=steps, max_new_tokens=NEW_TOKENS)
        assert engine.mode == "ngram"
        gen = engine.generate(prompt)
        assert gen.token_ids == greedy_reference(model, prompt, NEW_TOKENS), prompt
        assert sum(r.committed for r in gen.rounds) == NEW_TOKENS - 1
        for r in gen.rounds:
            assert 0 <= r.accepted <= r.drafted <= steps and r.depth == r.drafted
        accepted += sum(r.accepted for r in gen.rounds)
    assert accepted > 0  # the accept path (cache crop after a > 0) really ran


def test_greedy_ngram_is_lossless_with_eos_and_a_budget_above_the_union(setup):
    model, target, _ = setup
    prompt = repetitive_prompt(model)
    reference = greedy_reference(model, prompt, NEW_TOKENS)
    eos = reference[8]
    engine = SpeculativeEngine(target, NgramSpec(), steps=5, budget=target.num_experts, max_new_tokens=NEW_TOKENS,
                               eos_token_ids=[eos])
    gen = engine.generate(prompt)
    assert gen.token_ids == reference[: reference.index(eos) + 1]
    assert sum(r.accepted for r in gen.rounds) > 0


def test_repetitive_prompt_speculates(setup):
    model, target, _ = setup
    prompt = repetitive_prompt(model)
    engine = SpeculativeEngine(target, NgramSpec(), steps=5, max_new_tokens=12)
    gen = engine.generate(prompt)
    assert gen.token_ids == greedy_reference(model, prompt, 12)
    tau = sum(r.accepted + 1 for r in gen.rounds) / len(gen.rounds)
    assert tau > 1.5 and gen.target_forwards < 12


def test_tau_counts_delivered_tokens_only(setup):
    """The cap cuts the last round: τ = delivered tokens / rounds (max_new_tokens - 1 of them, the prefill's token
    excluded) <= K + 1, while Σ (accepted + 1) / rounds counts the cut acceptances too."""
    from vat.eval.metrics import PromptRun, summarize

    model, target, _ = setup
    for new_tokens in (9, 10, 11, 12):
        engine = SpeculativeEngine(target, NgramSpec(), steps=5, max_new_tokens=new_tokens)
        gen = engine.generate(repetitive_prompt(model))
        metrics = summarize([PromptRun("q", "c", [gen], [[]])], [1] * len(target.moe_layer_ids), target.num_experts)
        assert metrics["tau"] == pytest.approx((new_tokens - 1) / len(gen.rounds)) and metrics["tau"] <= 5 + 1
        cut = sum(r.accepted + 1 for r in gen.rounds) - (new_tokens - 1)
        assert metrics["accepted_per_round"] == pytest.approx(metrics["tau"] + cut / len(gen.rounds))


def test_budget_caps_ngram_verification(setup):
    model, target, prompts = setup
    prompt = repetitive_prompt(model)
    natural = SpeculativeEngine(target, NgramSpec(), steps=5, max_new_tokens=12).generate(prompt)
    assert max(max(r.union) for r in natural.rounds) > 2  # otherwise the budget is vacuous
    gen = SpeculativeEngine(target, NgramSpec(), steps=5, budget=2, max_new_tokens=12).generate(prompt)
    assert max(max(r.union) for r in gen.rounds) <= 2
    assert any(r.drafted > 0 for r in gen.rounds)
    with pytest.raises(VatError, match="--tree"):
        from vat.eval.tree import TreeSpec

        SpeculativeEngine(target, NgramSpec(), tree=TreeSpec(2, 2, 3))


def test_sampling_keeps_the_target_distribution():
    """T = 1 on an 8-token vocabulary: the prompt holds every token with a follower, so whatever the prefill samples,
    the first round drafts; the joint law of the two generated tokens must be the target's own."""
    vocab = 8
    model = tiny_model("olmoe", seed=3, vocab_size=vocab)
    with torch.no_grad():  # flatten the random target so every token has real mass
        model.lm_head.weight.mul_(0.3)
    target = load_target(model, device="cpu")
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 3, 5]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), dim=0)  # (V,)
        p2 = torch.stack([
            torch.softmax(model(torch.tensor([prompt + [x]])).logits[0, -1].double(), dim=0) for x in range(vocab)
        ])  # (V, V)
    joint = p1[:, None] * p2
    engine = SpeculativeEngine(target, NgramSpec(), steps=2, temperature=1.0, max_new_tokens=2)
    counts = torch.zeros(vocab, vocab)
    accepted = rejected = 0
    n = 600
    try:
        for seed in range(n):
            gen = engine.generate(prompt, torch.Generator().manual_seed(seed))
            x1, x2 = gen.token_ids
            counts[x1, x2] += 1
            assert len(gen.rounds) == 1 and gen.rounds[0].drafted >= 1
            accepted += gen.rounds[0].accepted > 0
            rejected += gen.rounds[0].accepted == 0
    finally:
        target.close()
    assert accepted > 50 and rejected > 50  # both branches of the point-mass rule ran
    stat, df = chi_square(counts, joint, zero_cells_empty=False)
    assert stat < chi_square_critical(df), (stat, df)
