"""`vat prep regen`: turn-by-turn greedy regeneration with a tiny random OLMoE, batching parity, resume."""

from __future__ import annotations

import json

import pytest
from test_prep_fixtures import build_small_tokenizer
from tiny_models import tiny_model
from vat.data_prep.readers import iter_records
from vat.data_prep.regen import Regenerator, regenerate_file

from vat.cli import main as vat_main


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread; on a shared, loaded CPU two OpenMP threads can be 100x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CHATS = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "Hello there!"},
            {"from": "gpt", "value": "old answer"},
            {"from": "human", "value": "The quick brown fox?"},
            {"from": "gpt", "value": "old"},
        ],
    },
    {
        "id": "b",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is Paris?"},
            {"role": "assistant", "content": "old"},
        ],
    },
    {"id": "c", "conversations": [{"from": "human", "value": "no answer here"}]},  # skipped: no assistant turn
    {"id": "d", "data": ["Write a function that adds two numbers.", "old", "And in Python?", "old"]},
]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    model = tiny_model("olmoe")
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(path))
    build_small_tokenizer().save_pretrained(str(path))
    return path


def _regen(target_dir, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target_dir))
    return Regenerator(model, AutoTokenizer.from_pretrained(str(target_dir)), **kw)


def test_turn_by_turn_greedy_matches_unbatched_generation(target_dir, tmp_path):
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in CHATS) + "\n")
    out = tmp_path / "regen.jsonl"
    regen = _regen(target_dir, max_new_tokens=6)
    stats = regenerate_file(str(src), str(out), regen, batch_size=3, progress=False)
    assert stats["read"] == 4 and stats["written"] == 3 and stats["skipped"] == {"no_assistant_turn": 1}
    rows = {r["id"]: r for r in iter_records(str(out))}
    assert set(rows) == {"a", "b", "d"}
    a = rows["a"]["conversations"]
    assert [t["from"] for t in a] == ["human", "gpt", "human", "gpt"]
    assert a[0]["value"] == "Hello there!" and a[2]["value"] == "The quick brown fox?"  # user turns verbatim
    assert rows["b"]["conversations"][0] == {"from": "system", "value": "Be brief."}
    # Every reply equals an unbatched greedy generation given the *regenerated* history (left padding is harmless).
    single = _regen(target_dir, max_new_tokens=6)
    for row in rows.values():
        history = []
        for turn in row["conversations"]:
            role = {"human": "user", "gpt": "assistant", "system": "system"}[turn["from"]]
            if role == "assistant":
                ((text, _),) = single.generate([history])
                assert turn["value"] == text and text != "old"
            history.append({"role": role, "content": turn["value"]})
    assert regen.counts["turns_generated"] == 5


def test_resume_skips_done_ids_and_repairs_a_cut_line(target_dir, tmp_path):
    src = tmp_path / "chats.json"
    src.write_text(json.dumps(CHATS[:2]))
    out = tmp_path / "regen.jsonl"
    regen = _regen(target_dir, max_new_tokens=4)
    assert regenerate_file(str(src), str(out), regen, progress=False)["written"] == 2
    first = out.read_text()
    with open(out, "a") as f:  # a killed run leaves half a line behind
        f.write('{"id": "d", "conversations": [{"fr')
    src.write_text(json.dumps(CHATS))
    stats = regenerate_file(str(src), str(out), regen, progress=False)
    assert stats["already_done"] == 2 and stats["written"] == 1
    text = out.read_text()
    assert text.startswith(first) and text.endswith("\n")
    ids = [r["id"] for r in iter_records(str(out))]
    assert ids == ["a", "b", "d"]
    assert json.loads((tmp_path / "regen.jsonl.stats.json").read_text())["already_done"] == 2


def test_cli_regen_with_limit(target_dir, tmp_path, capsys):
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in CHATS) + "\n")
    out = tmp_path / "o.jsonl"
    code = vat_main(
        [
            "prep",
            "regen",
            "--target",
            str(target_dir),
            "--input",
            str(src),
            "--output",
            str(out),
            "--max-new-tokens",
            "3",
            "--limit",
            "2",
            "--batch-size",
            "2",
        ]
    )
    assert code == 0 and [r["id"] for r in iter_records(str(out))] == ["a", "b"]
    assert "written 2" in capsys.readouterr().out
    assert (
        vat_main(["prep", "regen", "--target", str(tmp_path / "none"), "--input", str(src), "--output", str(out)]) == 2
    )


def test_sampling_is_seeded_and_differs_from_greedy(target_dir):
    import torch

    prompt = [[{"role": "user", "content": "Hello there!"}]] * 4
    sampler = _regen(target_dir, max_new_tokens=8, temperature=1.5)
    torch.manual_seed(0)
    first = sampler.generate(prompt)
    torch.manual_seed(0)
    assert sampler.generate(prompt) == first  # reproducible under a seed
    greedy = _regen(target_dir, max_new_tokens=8).generate(prompt)
    assert len({g for g, _ in greedy}) == 1  # greedy rows are identical ...
    assert len({s for s, _ in first}) > 1  # ... sampled rows are not (random tiny model, high temperature)
