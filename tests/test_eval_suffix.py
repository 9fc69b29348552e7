"""Suffix decoding: the count trie against plain occurrence counts, speculation against a trie-free reference, the
documented behaviour (probability threshold, match-length cap, local vs global cache), and the engine: lossless
greedy decoding, with the cache of earlier responses making a repeated request speculate."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import greedy_reference, tiny_model

from vat.errors import VatError
from vat.eval.engine import SpeculativeEngine
from vat.eval.free_drafts import DEFAULT_GRID, expand_baselines, parse_free_draft
from vat.eval.ngram import NgramSpec
from vat.eval.suffix import CountTrie, SuffixSpec, count_reference, speculate, speculate_reference
from vat.target import load_target

NEW_TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the trie and the speculation -------------------------------------------------------------------------------------


def test_trie_counts_equal_occurrence_counts():
    rng = random.Random(0)
    for depth in (2, 3, 6):
        seqs = [[rng.randrange(3) for _ in range(rng.randint(1, 30))] for _ in range(3)]
        trie = CountTrie(depth)
        for i, seq in enumerate(seqs):
            for start in range(0, len(seq), 4):  # grown in chunks, as rounds commit
                trie.extend(i, seq[start : start + 4])
        for _ in range(200):
            string = [rng.randrange(3) for _ in range(rng.randint(1, depth))]
            node = trie.find(string)
            assert (0 if node is None else node.count) == count_reference(seqs, string), string
        assert trie.find([0] * (depth + 1)) is None  # nothing deeper than the depth is kept


@pytest.mark.parametrize("spec", [SuffixSpec(max_depth=6), SuffixSpec(max_depth=4, min_token_prob=0.3),
                                  SuffixSpec(max_depth=8, max_spec_factor=0.5, max_spec_offset=1.0)])
def test_speculation_equals_the_trie_free_reference(spec):
    rng = random.Random(spec.max_depth)
    for _ in range(40):
        vocab = rng.choice([2, 3, 4])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(2, 25))] for _ in range(rng.randint(1, 3))]
        trie = CountTrie(spec.max_depth)
        for i, seq in enumerate(seqs):
            trie.extend(i, seq)
        context = seqs[-1][-rng.randint(2, 10):]
        k = rng.randint(1, 8)
        assert speculate(trie, context, k, spec).tokens == speculate_reference(seqs, context, k, spec), (seqs, context)


def test_documented_behaviour_on_hand_built_cases():
    spec = SuffixSpec(max_depth=24)
    trie = CountTrie(24)
    trie.extend(0, [1, 2, 3, 1, 2, 4, 1, 2, 3, 9])
    # after [1, 2]: 3 follows twice, 4 once (of 3 occurrences): p = 2/3; then 3 -> (1 of 2 occurrences of [1,2,3]) ...
    d = speculate(trie, [5, 1, 2], 8, spec)
    assert d.tokens[:1] == [3] and d.probs[0] == pytest.approx(2 / 3) and d.match_len == 2
    # the match-length cap: one matched token allows one drafted token (factor 1, offset 0)
    assert len(speculate(trie, [7, 9], 8, spec).tokens) <= 1
    # the probability threshold: with min_token_prob 0.7 the 2/3 token is not drafted
    assert speculate(trie, [5, 1, 2], 8, SuffixSpec(min_token_prob=0.7)).tokens == []
    with pytest.raises(VatError, match="depth"):
        SuffixSpec(max_depth=1)


def test_free_draft_names():
    assert parse_free_draft("ngram-vllm-5-5") == NgramSpec(5, 5, "vllm")
    assert parse_free_draft("ngram-recent-1-3") == NgramSpec(3, 1, "recent")
    assert parse_free_draft("ngram", NgramSpec(4, 2)) == NgramSpec(4, 2)
    assert parse_free_draft("suffix") == SuffixSpec()
    assert parse_free_draft("suffix-d12-local") == SuffixSpec(max_depth=12, use_global=False)
    assert parse_free_draft("runs/x/final") is None and parse_free_draft("none") is None
    for name in DEFAULT_GRID:
        assert parse_free_draft(name).label == name  # labels round-trip
    with pytest.raises(VatError, match="free draft"):
        parse_free_draft("ngram-5")
    assert expand_baselines(["ngram-vllm-1-3", "free", "none"]) == ["ngram-vllm-1-3", *DEFAULT_GRID[1:], "none"]


# ---- the engine ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("olmoe", seed=2)
    target = load_target(model, device="cpu")
    gen = torch.Generator().manual_seed(99)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 13)]
    yield model, target, prompts
    target.close()


@pytest.mark.parametrize("steps", [3, 7])
def test_greedy_suffix_decoding_is_lossless_and_the_cache_carries_across_requests(setup, steps):
    model, target, prompts = setup
    engine = SpeculativeEngine(target, SuffixSpec(), steps=steps, max_new_tokens=NEW_TOKENS)
    assert engine.mode == "ngram"
    first_pass = []
    for prompt in [*prompts, *prompts]:  # the second time, the pass's cache holds each prompt's whole answer
        gen = engine.generate(prompt)
        assert gen.token_ids == greedy_reference(model, prompt, NEW_TOKENS), prompt
        assert all(0 <= r.accepted <= r.drafted <= steps for r in gen.rounds)
        first_pass.append(len(gen.rounds))
    for before, again in zip(first_pass[: len(prompts)], first_pass[len(prompts):]):
        assert again < before  # the repeated request is drafted from the earlier response
    engine.start_pass()
    fresh = engine.generate(prompts[0])
    assert len(fresh.rounds) == first_pass[0]  # an emptied cache decodes as the first time
