"""`vat prep regen`: turn-by-turn greedy regeneration with a tiny random OLMoE, batching parity, resume."""

from __future__ import annotations

import json
import os

import datasets
import pytest
from helpers import build_small_tokenizer
from tiny_models import tiny_model

from vat.cli import main as vat_main
from vat.data_prep.readers import iter_records
from vat.data_prep.regen import Regenerator, regenerate_file

pytestmark = pytest.mark.usefixtures("one_thread")


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


# --------------------------------------------------------------------------------------- fast path (issue 12)

MORE_CHATS = CHATS + [
    {"id": "e", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"}]},
    {
        "id": "f",
        "conversations": [
            {"from": "human", "value": "Mixture of experts models route every token to a few experts per layer. " * 3},
            {"from": "gpt", "value": "old"},
            {"from": "human", "value": "the the the"},
            {"from": "gpt", "value": "old"},
            {"from": "human", "value": "And in Python?"},
            {"from": "gpt", "value": "old"},
        ],
    },
    {"id": "g", "conversations": [{"from": "human", "value": "What is Paris? " * 4}, {"from": "gpt", "value": "o"}]},
    {"id": "h", "conversations": [{"from": "human", "value": "Be brief."}, {"from": "gpt", "value": "old"}]},
]


@pytest.fixture(scope="module")
def stopping_target_dir(tmp_path_factory):
    """The tiny random target with a second stop token it often generates, so replies end at different steps
    (a random model almost never emits its EOS): batches shrink mid-generation and some turns are truncated."""
    path = tmp_path_factory.mktemp("tiny_target_stopping")
    model = tiny_model("olmoe")
    model.generation_config.eos_token_id = [1, 80]
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(path))
    build_small_tokenizer().save_pretrained(str(path))
    return path


def _write(path, chats):
    path.write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    return str(path)


def test_generate_ids_matches_hf_generate(stopping_target_dir):
    """The KV-cached loop (left padding, rows dropped when they stop, new rows joining the running batch) equals HF
    greedy ``generate`` row by row."""
    import torch

    regen = _regen(stopping_target_dir, max_new_tokens=24, batch_size=3)
    prompts = [regen.prompt_ids([{"role": "user", "content": c["conversations"][0]["value"]}]) for c in MORE_CHATS
               if "conversations" in c]
    ours = regen.generate_ids(prompts)
    assert {e for _, e in ours} == {True, False}  # both stopped and truncated rows
    for ids, (new, ended) in zip(prompts, ours):
        x = torch.tensor([ids])
        ref = regen.model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
            eos_token_id=regen.stop_ids, pad_token_id=0,
        )[0, len(ids):].tolist()
        stop = next((i for i, t in enumerate(ref) if t in regen.stop_ids), None)
        assert new == (ref if stop is None else ref[:stop]) and ended == (stop is not None)


def test_bucketed_batched_regen_matches_batch_size_one(stopping_target_dir, tmp_path):
    """The parity test of the fast path: length-bucketed batches of 3 in pools of 8 give, per conversation, the same
    text (and truncation flags) as one conversation at a time (greedy, fp32); the output keeps the input order."""
    src = _write(tmp_path / "chats.jsonl", MORE_CHATS)
    outs = {}
    for name, batch, pool in (("one", 1, 1), ("bucketed", 3, 8)):
        out = tmp_path / f"{name}.jsonl"
        regen = _regen(stopping_target_dir, max_new_tokens=12, batch_size=batch)
        stats = regenerate_file(src, str(out), regen, progress=False, pool_size=pool)
        outs[name] = out.read_text()
        assert stats["written"] == 7 and stats["generation"]["turns_generated"] == 11
    assert outs["bucketed"] == outs["one"]
    rows = [json.loads(line) for line in outs["one"].splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "d", "e", "f", "g", "h"]
    flags = [t.get("truncated", False) for r in rows for t in r["conversations"] if t["from"] == "gpt"]
    assert True in flags and False in flags
    # prefill runs groups of similar length: at most 10 % padding
    assert stats["generation"]["prefill_tokens"] <= 1.1 * stats["generation"]["prompt_tokens"]


def test_resumed_bucketed_run_equals_an_uninterrupted_one(stopping_target_dir, tmp_path):
    src = _write(tmp_path / "chats.jsonl", MORE_CHATS)
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    regenerate_file(src, str(full), _regen(stopping_target_dir, max_new_tokens=8, batch_size=2), progress=False)
    regen = _regen(stopping_target_dir, max_new_tokens=8, batch_size=2)
    assert regenerate_file(src, str(resumed), regen, progress=False, limit=4)["written"] == 3  # killed after a, b, d
    with open(resumed, "a") as f:
        f.write('{"id": "e", "conv')  # ... in the middle of writing the next pool
    stats = regenerate_file(src, str(resumed), regen, progress=False, pool_size=3)
    assert stats["already_done"] == 3 and stats["written"] == 4
    assert resumed.read_text() == full.read_text()


def test_max_turns_and_max_prompt_tokens(stopping_target_dir, tmp_path):
    src = _write(tmp_path / "chats.jsonl", MORE_CHATS)
    out = tmp_path / "o.jsonl"
    regen = _regen(stopping_target_dir, max_new_tokens=4, max_turns=1, max_prompt_tokens=40)
    stats = regenerate_file(src, str(out), regen, progress=False)
    rows = {r["id"]: r["conversations"] for r in iter_records(str(out))}
    assert all(sum(t["from"] == "gpt" for t in c) == 1 for c in rows.values())  # first assistant turn only
    assert stats["generation"]["conversations_cut_at_max_turns"] == 3  # a, d, f had more
    # f's and g's first prompts are longer than 40 tokens: the conversation ends before them (nothing to write)
    assert "f" not in rows and "g" not in rows
    assert stats["generation"]["stopped_prompt_too_long"] == 2
    assert stats["skipped"]["nothing_generated"] == 2 and stats["max_prompt_tokens"] == 40


def test_truncated_turns_flagged_and_throughput_stats_written(stopping_target_dir, tmp_path, capsys):
    src = _write(tmp_path / "chats.jsonl", MORE_CHATS)
    out = tmp_path / "o.jsonl"
    args = ["prep", "regen", "--target", str(stopping_target_dir), "--input", src, "--output", str(out),
            "--max-new-tokens", "12", "--batch-size", "4", "--max-turns", "2"]
    assert vat_main(args) == 0
    printed = capsys.readouterr().out
    assert "new tokens" in printed and "tok/s" in printed
    stats = json.loads((tmp_path / "o.jsonl.stats.json").read_text())
    gen = stats["generation"]
    assert stats["new_tokens"] == gen["new_tokens"] > 0 and stats["new_tokens_per_second"] > 0
    assert stats["conversations_per_second"] > 0 and stats["batch_size"] == 4 and stats["max_turns"] == 2
    assert 0 < gen["turns_truncated"] < gen["turns_generated"]
    # the flag is exactly "no stop token within max_new_tokens" (checked against unbatched generation)
    regen = _regen(stopping_target_dir, max_new_tokens=12)
    truncated = 0
    for row in iter_records(str(out)):
        history = []
        for turn in row["conversations"]:
            role = {"human": "user", "gpt": "assistant", "system": "system"}[turn["from"]]
            if role == "assistant":
                ((ids, ended),) = regen.generate_ids([regen.prompt_ids(history)])
                assert bool(turn.get("truncated")) == (not ended)
                assert len(ids) == 12 or ended
                truncated += not ended
            history.append({"role": role, "content": turn["value"]})
    assert truncated == gen["turns_truncated"]


def test_truncated_turn_gets_no_end_of_turn_supervision_after_prep_chat(stopping_target_dir, tmp_path):
    """regen -> prep chat on the target's own tokenizer: a truncated reply keeps its content in the loss, not its
    <|im_end|>; a finished reply keeps both."""
    from vat.data_prep.chat import prepare_chat
    from vat.data_prep.templates import encode_conversations

    src = _write(tmp_path / "chats.jsonl", MORE_CHATS)
    out = tmp_path / "o.jsonl"
    regenerate_file(src, str(out), _regen(stopping_target_dir, max_new_tokens=12), progress=False)
    tok = build_small_tokenizer()
    data = tmp_path / "data"
    stats = prepare_chat(str(out), tok, str(data), progress=False)
    assert stats["rows_kept"] == 7
    ds = datasets.load_from_disk(str(data))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    seen = {True: 0, False: 0}
    for row in iter_records(str(out)):
        (got,) = [r for r in ds if r["id"] == row["id"]]
        messages = [{"role": {"human": "user", "gpt": "assistant", "system": "system"}[t["from"]],
                     "content": t["value"]} for t in row["conversations"]]
        (plain,) = encode_conversations(tok, [messages])  # what the mask would be without the flags
        assert got["input_ids"] == plain.input_ids
        # the end-of-turn token after each assistant turn, in order
        ends = [i for i in range(1, len(plain.input_ids)) if plain.input_ids[i] == eot and plain.loss_mask[i]]
        gpt_turns = [t for t in row["conversations"] if t["from"] == "gpt"]
        assert len(ends) == len(gpt_turns)
        for turn, i in zip(gpt_turns, ends):
            flag = bool(turn.get("truncated"))
            seen[flag] += 1
            assert got["loss_mask"][i] == (0 if flag else 1)
            assert got["loss_mask"][i - 1] == 1  # the content's last token is still supervised
        # nothing else changed
        assert [m for k, m in enumerate(got["loss_mask"]) if k not in ends] == [
            m for k, m in enumerate(plain.loss_mask) if k not in ends]
    assert seen[True] and seen[False]


def test_tiny_regen_data_is_built_cached_and_resumable(tmp_path, monkeypatch):
    """`data.train: tiny-regen`: the embedded target's own answers to the first ShareGPT rows, prepared with the
    assistant-only mask, cached under $VAT_HOME/data with its settings in the name; the regen file is resumed.
    A tiny random target stands in for the quick build (same place, same report keys)."""
    from tiny_models import save_tiny_target

    from vat.data_prep.tiny_target import REPORT_FILE
    from vat.paths import sharegpt_path, tiny_cache_name, tiny_seed, tiny_target_dir
    from vat.train import defaults

    monkeypatch.setenv("VAT_HOME", str(tmp_path))
    target = tmp_path / os.path.basename(tiny_target_dir("quick"))  # -seedN under $VAT_TINY_SEED = N
    save_tiny_target(str(target), "olmoe")
    (target / REPORT_FILE).write_text(json.dumps({"quick": True, "seed": tiny_seed()}))
    kw = dict(conversations=12, max_new_tokens=8, max_length=512, max_turns=1, batch_size=4, progress=False)
    name = f"{tiny_cache_name('tiny-quick')}-regen-c12-n8-t1-p240"
    regen_file = tmp_path / "data" / f"{name}.jsonl"
    # a killed build left the first rows of the regen file behind
    first = regenerate_file(
        sharegpt_path(),
        str(regen_file),
        _regen(target, max_new_tokens=8, max_turns=1, max_prompt_tokens=240, batch_size=4),
        limit=5,
        progress=False,
    )
    assert first["written"] > 0
    out = defaults.ensure_tiny_regen_data("tiny-quick", **kw)
    assert out == str(tmp_path / "data" / f"{name}-512")
    regen_stats = json.loads((tmp_path / "data" / f"{name}.jsonl.stats.json").read_text())
    assert regen_stats["already_done"] == first["written"] and regen_stats["read"] == 12
    chat_stats = json.loads((tmp_path / "data" / f"{name}-512" / "stats.json").read_text())
    assert chat_stats["rows_kept"] == first["written"] + regen_stats["written"] > 0
    ds = datasets.load_from_disk(out)
    assert max(ds["length"]) <= 256 and all(any(m) for m in ds["loss_mask"])
    # cached: a second call returns at once; the resolver maps the recipe names
    mtime = (tmp_path / "data" / f"{name}-512" / "stats.json").stat().st_mtime
    assert defaults.ensure_tiny_regen_data("tiny-quick", **kw) == out
    assert (tmp_path / "data" / f"{name}-512" / "stats.json").stat().st_mtime == mtime
    assert defaults.resolve_train_data("some/prepared/dir", "tiny-quick", 512) == "some/prepared/dir"
    with pytest.raises(Exception, match="embedded target"):
        defaults.resolve_train_data("tiny-regen", "/some/other/target", 512)


def test_every_max_length_cut_of_one_regen_file_takes_the_same_lock(monkeypatch, tmp_path):
    """Two runs wanting different cuts (max_length 512 and 1024) of the same regenerated file must serialise on the
    file itself: each appends to it and skips only the ids done when it started (seen: 96 duplicated rows)."""
    import contextlib

    import vat.data_prep.tiny_target as tt
    from vat.train.defaults import ensure_tiny_regen_data

    monkeypatch.setenv("VAT_HOME", str(tmp_path))
    seen = []

    class Stop(Exception):
        pass

    @contextlib.contextmanager
    def recording_lock(path):
        seen.append(path)
        raise Stop  # nothing past the lock runs: no target, no generation
        yield

    monkeypatch.setattr(tt, "build_lock", recording_lock)
    for max_length in (512, 1024):
        with pytest.raises(Stop):
            ensure_tiny_regen_data("tiny-quick", max_length=max_length)
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0].endswith(".jsonl")


def test_the_mixed_source_is_written_under_its_own_lock(tmp_path, monkeypatch):
    """The bench target's greedy and T = 1 regenerations hold different locks (their regen files) but read one mixed
    source file: it is written under a lock of its own, so two shards starting together never write it at once."""
    import contextlib

    import vat.data_prep.tiny_target as tt
    from vat.train.defaults import _tiny_regen_plan, _tiny_regen_source

    held = []
    plain = tt.build_lock

    @contextlib.contextmanager
    def recording_lock(path):
        with plain(path):
            held.append(path)
            yield

    monkeypatch.setattr(tt, "build_lock", recording_lock)
    plan = _tiny_regen_plan("tiny-bench", 40, None, 512, None, 1.0)
    source = _tiny_regen_source("tiny-bench", plan, str(tmp_path))
    assert held == [source] and os.path.getsize(source) > 0
    assert _tiny_regen_source("tiny-bench", plan, str(tmp_path)) == source  # found: written once
