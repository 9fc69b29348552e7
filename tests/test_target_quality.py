"""The target-quality table: its metrics on hand-built answers, and the table on a tiny random target against
independent references (`vat profile`'s natural union, a plain greedy loop)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from vat.eval.target_quality import (
    distinct_ngram_ratio,
    distinct_prefix_share,
    greedy_answers,
    looks_like_code,
    quality_markdown,
    summarize_answers,
    target_quality,
)
from vat.target import load_target


def test_distinct_prefix_share_counts_prompts_whose_head_no_other_prompt_has():
    same = [5, 6, 7, 8]
    assert distinct_prefix_share([same, same, same]) == 0.0  # one answer for every prompt
    assert distinct_prefix_share([same, [5, 6, 7, 9], [1]]) == 1.0
    assert distinct_prefix_share([same, same + [1], [2]], prefix=4) == pytest.approx(1 / 3)  # equal first 4 tokens
    assert distinct_prefix_share([same, same + [1], [2]], prefix=5) == 1.0
    with pytest.raises(ValueError):
        distinct_prefix_share([])


def test_distinct_ngram_ratio_goes_to_zero_on_a_loop():
    assert distinct_ngram_ratio([1, 2, 3, 4, 5, 6]) == 1.0
    loop = [1, 2, 3] * 10  # 27 4-grams, 3 distinct
    assert distinct_ngram_ratio(loop) == pytest.approx(3 / 27)
    assert distinct_ngram_ratio([1, 2, 3]) is None
    assert distinct_ngram_ratio([7, 7, 7, 7, 7], n=2) == pytest.approx(1 / 4)


@pytest.mark.parametrize("text,expected", [
    ("```python\ndef add(a, b):\n    return a + b\n```", True),
    ("def add(a, b):\n    return a + b\n\nprint(add(1, 2)) and then some words that", True),  # cut mid-way
    ("Sure, here are some of the \"The \"The \"The \"The", False),
    ("the following of the following of the following", False),
    ("x", False),  # one line: not enough to call it code
    ("```\nimport os\nprint(os.getcwd())\n```", True),
    ("Here is the function:\n```python\nclass A:\n    pass\n", True),  # an unclosed fence
])
def test_looks_like_code(text, expected):
    assert looks_like_code(text) is expected


def test_summarize_answers_on_hand_built_answers():
    answers = [
        {"answer_ids": [1, 2, 3, 4, 5], "ended": True, "text": "def f():\n    return 1"},
        {"answer_ids": [1, 2, 3, 4, 5], "ended": False, "text": "the the the the"},
        {"answer_ids": [9, 9, 9, 9, 9, 9], "ended": True, "text": "x = 1\ny = 2"},
    ]
    row = summarize_answers(answers, code=True)
    assert row["n_prompts"] == 3 and row["distinct_prefix_share"] == pytest.approx(1 / 3)
    assert row["distinct_4gram_ratio"] == pytest.approx((1.0 + 1.0 + 1 / 3) / 3)
    assert row["ended_share"] == pytest.approx(2 / 3) and row["code_share"] == pytest.approx(2 / 3)
    assert summarize_answers(answers, code=False)["code_share"] is None


@pytest.fixture(scope="module")
def tiny():
    tokenizer = tiny_tokenizer()
    model = tiny_model("olmoe", seed=3, vocab_size=len(tokenizer), num_experts=8, top_k=2)
    model.config.eos_token_id = tokenizer.eos_token_id
    target = load_target(model, device="cpu")
    yield model, target, tokenizer
    target.close()


def test_greedy_answers_are_the_targets_own_greedy_decode(tiny):
    model, target, tokenizer = tiny
    answers = greedy_answers(target, tokenizer, ["The quick brown fox", "def add(a, b):"], max_new_tokens=6)
    for a in answers:
        ids = list(a["prompt_ids"])
        with torch.no_grad():  # a plain loop of full forwards: no cache, no engine
            for _ in range(len(a["answer_ids"])):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert ids[len(a["prompt_ids"]):] == a["answer_ids"]
        assert a["ended"] or len(a["answer_ids"]) == 6  # the cap counts the prefill's token
        assert a["text"] == tokenizer.decode(a["answer_ids"], skip_special_tokens=True)


def test_quality_table_union_is_the_profiles_natural_union(tiny):
    from vat.profile import profile_target

    _, target, tokenizer = tiny
    questions = {"chat": ["The quick brown fox", "Translate the following sentence"], "humaneval": ["def add(a, b):"]}
    report = target_quality(target, tokenizer, questions, max_new_tokens=10, window=4)
    assert set(report["benchmarks"]) == {"chat", "humaneval"} and report["settings"]["num_experts"] == 8
    chat = report["benchmarks"]["chat"]
    assert chat["code_share"] is None and report["benchmarks"]["humaneval"]["code_share"] is not None
    answers = greedy_answers(target, tokenizer, questions["chat"], max_new_tokens=10)
    prof = profile_target(target, [a["prompt_ids"] + a["answer_ids"] for a in answers], window=4, progress=False)
    assert chat["natural_union_fraction"] == pytest.approx([u / 8 for u in prof["union_by_layer"]], rel=1e-9)
    assert chat["natural_union_fraction_mean"] == pytest.approx(prof["natural_mean_union"] / 8, rel=1e-9)
    assert chat["example"]["answer"] == answers[0]["text"]
    md = quality_markdown(report)
    assert "| chat | 2 |" in md and "54 of 64 experts" in md and "**humaneval**, first prompt" in md
