"""`vat prep chat`: golden loss masks per chat template, bad rows counted by reason, truncated files, CLI errors."""

from __future__ import annotations

import gzip
import json

import datasets
import pytest
from helpers import CHATML, CHATML_GENERATION, LLAMA3, QWEN3, build_tokenizer

from vat.cli import main as vat_main
from vat.data_prep.chat import SKIP_REASONS, normalize_record, prepare_chat
from vat.data_prep.readers import ReadStats, iter_records
from vat.data_prep.templates import DIFF_METHOD, MARKER_METHOD, encode_conversations, mask_method

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello! How are you?"},
    {"role": "assistant", "content": "I am fine, thanks."},
    # The user quotes the next answer verbatim: a plain text search would mask the user's copy.
    {"role": "user", "content": "Repeat after me: The capital of France is Paris."},
    {"role": "assistant", "content": "The capital of France is Paris."},
]

TEMPLATES = {
    "chatml": (CHATML, DIFF_METHOD, "<|im_end|>"),
    "chatml_generation": (CHATML_GENERATION, MARKER_METHOD, "<|im_end|>"),
    "llama3": (LLAMA3, DIFF_METHOD, "<|eot_id|>"),
    "qwen3": (QWEN3, DIFF_METHOD, "<|im_end|>"),
}


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for token, m in zip(ids, mask):
        if m:
            cur.append(token)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_golden_mask_is_assistant_content_plus_end_of_turn(name):
    template, method, eot = TEMPLATES[name]
    tok = build_tokenizer(template)
    assert mask_method(tok) == method
    (enc,) = encode_conversations(tok, [CONV])
    # The sequence is exactly the template's rendering ...
    assert enc.input_ids == tok(tok.apply_chat_template(CONV, tokenize=False), add_special_tokens=False)["input_ids"]
    assert len(enc.loss_mask) == len(enc.input_ids)
    # ... and the mask covers exactly each assistant content followed by its end-of-turn token.
    runs = [tok.decode(r) for r in _runs(enc.input_ids, enc.loss_mask)]
    assert runs == ["I am fine, thanks." + eot, "The capital of France is Paris." + eot]
    eot_id = tok.convert_tokens_to_ids(eot)
    masked_eot = [i for i, (t, m) in enumerate(zip(enc.input_ids, enc.loss_mask)) if t == eot_id and m]
    assert len(masked_eot) == 2


def test_qwen3_think_block_of_last_turn_is_not_supervised():
    tok = build_tokenizer(QWEN3)
    (enc,) = encode_conversations(tok, [CONV])
    text = tok.decode(enc.input_ids)
    assert "<think>\n\n</think>\n\nThe capital" in text  # the template did add it ...
    masked = "".join(tok.decode(r) for r in _runs(enc.input_ids, enc.loss_mask))
    assert "think" not in masked  # ... and it is not in the loss


def test_llama3_trimmed_content_still_found():
    tok = build_tokenizer(LLAMA3)
    conv = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "  Hello! How can I help?\n"}]
    (enc,) = encode_conversations(tok, [conv])
    assert [tok.decode(r) for r in _runs(enc.input_ids, enc.loss_mask)] == ["Hello! How can I help?<|eot_id|>"]


def test_normalize_layouts_and_roles():
    share = {
        "conversations": [
            {"from": "gpt", "value": "hi"},
            {"from": "human", "value": "q"},
            {"from": "chatgpt", "value": "a"},
        ]
    }
    msgs, reason, info = normalize_record(share)
    assert reason is None and info["dropped_leading_turns"] == 1
    assert msgs == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ultra = {"data": ["q1", "a1", "q2"]}
    msgs, reason, info = normalize_record(ultra)
    assert [m["role"] for m in msgs] == ["user", "assistant"] and info["dropped_trailing_turns"] == 1
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "x"}]},
            {"role": "assistant", "content": "y"},
        ]
    }
    assert normalize_record(parts)[0][0]["content"] == "x"
    assert normalize_record({"messages": [{"role": "user", "content": "q"}]}, fmt="sharegpt")[1] == "unknown_format"


def _bad_rows_file(path):
    good_share = {
        "id": "s1",
        "conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "Hi there."}],
    }
    good_msgs = {
        "id": "m1",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    }
    good_ultra = {"id": "u1", "data": ["What is the capital of France?", "Paris."]}
    lines = [
        json.dumps(good_share),
        '{"id": "broken", "conversations": [',  # malformed_json
        json.dumps({"id": "b1", "conversations": [{"from": "human", "value": "only a question"}]}),  # no_assistant_turn
        json.dumps(
            {"id": "b2", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}
        ),  # empty_turn
        json.dumps(
            {"id": "b3", "conversations": [{"from": "robot", "value": "q"}, {"from": "gpt", "value": "a"}]}
        ),  # unknown_role
        json.dumps(
            {"id": "b4", "messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "a"}]}
        ),  # non_string_content
        json.dumps(
            {"id": "b5", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "word " * 200}]}
        ),  # over_length
        json.dumps({"id": "b6", "text": "not a chat"}),  # unknown_format
        json.dumps(good_msgs),
        json.dumps(good_ultra),
    ]
    path.write_text("\n".join(lines) + "\n")


def test_bad_rows_counted_good_rows_kept(tmp_path):
    src = tmp_path / "chats.jsonl"
    _bad_rows_file(src)
    out = tmp_path / "new" / "sub" / "prepared"  # parents are created
    stats = prepare_chat(str(src), build_tokenizer(CHATML), str(out), max_length=128, progress=False)
    assert stats["rows_read"] == 10 and stats["rows_kept"] == 3
    expected = {
        "malformed_json": 1,
        "no_assistant_turn": 1,
        "empty_turn": 1,
        "unknown_role": 1,
        "non_string_content": 1,
        "over_length": 1,
        "unknown_format": 1,
    }
    assert {k: v for k, v in stats["skipped"].items() if v} == expected
    assert set(stats["skipped"]) == set(SKIP_REASONS)
    assert stats["rows_read"] == stats["rows_kept"] + sum(stats["skipped"].values())
    assert json.loads((out / "stats.json").read_text()) == stats
    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == ["input_ids", "loss_mask", "length", "id"]
    assert ds["id"] == ["s1", "m1", "u1"]
    for row in ds:
        assert (
            row["length"] == len(row["input_ids"]) == len(row["loss_mask"])
            and 0 < sum(row["loss_mask"]) < row["length"]
        )
    assert stats["tokens_kept"] == sum(ds["length"])
    assert stats["loss_tokens_kept"] == sum(sum(m) for m in ds["loss_mask"])


def test_num_proc_2_matches_num_proc_1(tmp_path):
    src = tmp_path / "chats.json"
    rows = [
        {
            "id": f"r{i}",
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": "The answer is " + "yes " * (i % 7)},
            ],
        }
        for i in range(40)
    ]
    src.write_text(json.dumps(rows))
    tok = build_tokenizer(CHATML_GENERATION)
    s1 = prepare_chat(str(src), tok, str(tmp_path / "p1"), num_proc=1, progress=False)
    s2 = prepare_chat(str(src), tok, str(tmp_path / "p2"), num_proc=2, progress=False)
    d1, d2 = datasets.load_from_disk(str(tmp_path / "p1")), datasets.load_from_disk(str(tmp_path / "p2"))
    assert s1["rows_kept"] == s2["rows_kept"] == 40
    assert d1["input_ids"] == d2["input_ids"] and d1["loss_mask"] == d2["loss_mask"] and d1["id"] == d2["id"]


def test_truncated_json_array_keeps_complete_records(tmp_path):
    rows = [
        {"id": f"t{i}", "conversations": [{"from": "human", "value": f"Hi {i}"}, {"from": "gpt", "value": "Hello!"}]}
        for i in range(5)
    ]
    text = json.dumps(rows, indent=2)
    cut = text.index('"t4"') + 10  # inside the last record
    src = tmp_path / "cut.json"
    src.write_text(text[:cut])
    read = ReadStats()
    assert [r["id"] for r in iter_records(str(src), read)] == ["t0", "t1", "t2", "t3"]
    assert read.truncated_tail and read.truncated_at_char is not None and read.truncated_tail_chars > 0
    stats = prepare_chat(str(src), build_tokenizer(CHATML), str(tmp_path / "out"), progress=False)
    assert stats["rows_read"] == stats["rows_kept"] == 4
    assert stats["truncated_tail"]["truncated"] is True


def test_reader_jsonl_gz_malformed_and_cut(tmp_path):
    lines = [json.dumps({"i": i}) for i in range(6)]
    lines.insert(2, "{not json")
    text = "\n".join(lines) + "\n" + '{"i": 99, "cut'
    path = tmp_path / "x.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(text)
    read = ReadStats()
    assert [r["i"] for r in iter_records(str(path), read)] == list(range(6))
    assert read.malformed_json == 1 and read.truncated_tail and read.format == "jsonl"
    raw = path.read_bytes()  # a cut-off gzip stream: everything decompressable is still read, and the cut reported
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(json.dumps([{"i": i} for i in range(2000)]).encode())[:3000])
    read = ReadStats()
    got = list(iter_records(str(tmp_path / "cut.json.gz"), read))
    assert len(got) > 100 and got == [{"i": i} for i in range(len(got))] and read.truncated_tail
    assert raw  # the first file was read intact


def test_hub_path_via_load_dataset_json(tmp_path):
    src = tmp_path / "chats.jsonl"
    _bad_rows_file(src)
    lines = [line for line in src.read_text().splitlines() if line.endswith("}") and '"b' not in line]
    src.write_text("\n".join(lines) + "\n")  # load_dataset needs a consistent schema: keep the good rows
    stats = prepare_chat(
        "json", build_tokenizer(CHATML), str(tmp_path / "out"), hub_kwargs={"data_files": str(src)}, progress=False
    )
    assert stats["source"] == "datasets" and stats["rows_kept"] == stats["rows_read"] == len(lines)


def test_cli_missing_input_is_one_line(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    build_tokenizer(CHATML).save_pretrained(str(tok_dir))
    code = vat_main(
        [
            "prep",
            "chat",
            "--input",
            str(tmp_path / "nope.json"),
            "--tokenizer",
            str(tok_dir),
            "--output",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("vat: error:") and "nope.json" in err and "\n" not in err


def test_cli_end_to_end(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    build_tokenizer(LLAMA3).save_pretrained(str(tok_dir))
    src = tmp_path / "chats.jsonl"
    _bad_rows_file(src)
    out = tmp_path / "out"
    assert (
        vat_main(
            [
                "prep",
                "chat",
                "--input",
                str(src),
                "--tokenizer",
                str(tok_dir),
                "--output",
                str(out),
                "--max-length",
                "128",
                "--limit",
                "5",
            ]
        )
        == 0
    )
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows_read"] == 5 and stats["rows_kept"] == 1
    assert "rows read 5, kept 1" in capsys.readouterr().out


def test_unreachable_hub_name_is_a_vat_error(tmp_path):
    from vat.errors import VatError

    with pytest.raises(VatError, match="could not load dataset"):
        prepare_chat("vat-test/no-such-dataset", build_tokenizer(CHATML), str(tmp_path / "out"), progress=False)


def test_render_diff_agrees_with_generation_markers_on_tricky_content():
    # Same ChatML text with and without {% generation %}: both masking methods must give identical ids and masks.
    convs = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello!  \n"}],
        [
            {"role": "user", "content": "Say Hi"},
            {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hi"},
        ],
        [
            {"role": "system", "content": "assistant"},
            {"role": "user", "content": "assistant\nHello"},
            {"role": "assistant", "content": "assistant"},
            {"role": "user", "content": "<|im_end|>"},
            {"role": "assistant", "content": "def add(a, b): return a + b"},
        ],
    ]
    plain = encode_conversations(build_tokenizer(CHATML), convs)
    marked = encode_conversations(build_tokenizer(CHATML_GENERATION), convs)
    for p, m in zip(plain, marked):
        assert p.input_ids == m.input_ids and p.loss_mask == m.loss_mask


def test_rerun_replaces_a_prepared_dataset_but_not_other_dirs(tmp_path):
    from vat.errors import VatError

    src = tmp_path / "chats.jsonl"
    _bad_rows_file(src)
    tok = build_tokenizer(CHATML)
    out = tmp_path / "out"
    prepare_chat(str(src), tok, str(out), max_length=128, progress=False)
    stats = prepare_chat(str(src), tok, str(out), max_length=128, limit=1, progress=False)
    assert stats["rows_kept"] == 1 and len(datasets.load_from_disk(str(out))) == 1
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(VatError, match="refusing to overwrite"):
        prepare_chat(str(src), tok, str(other), progress=False)
    assert (other / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("name", list(TEMPLATES) + ["tiny_target"])
@pytest.mark.parametrize("cut", [2, 4])
def test_truncated_turn_has_no_end_of_turn_supervision(name, cut, tmp_path):
    """A reply cut at the generation budget (``"truncated": true``, written by `vat prep regen`) keeps its content in
    the loss but not the end-of-turn token the template adds after it; the other turns are unchanged."""
    from vat.data_prep.tokenizer_train import CHAT_TEMPLATE

    template, _, eot = TEMPLATES[name] if name in TEMPLATES else (CHAT_TEMPLATE, MARKER_METHOD, "<|im_end|>")
    tok = build_tokenizer(template)
    turns = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
             for m in CONV]
    turns[cut]["truncated"] = True
    src = tmp_path / "regen.jsonl"
    src.write_text(json.dumps({"id": "x", "conversations": turns}) + "\n")
    stats = prepare_chat(str(src), tok, str(tmp_path / "out"), progress=False)
    assert stats["rows_kept"] == 1
    row = datasets.load_from_disk(str(tmp_path / "out"))[0]
    (plain,) = encode_conversations(tok, [CONV])
    assert row["input_ids"] == plain.input_ids  # the sequence is the same; only the mask changes
    runs = [tok.decode(r) for r in _runs(row["input_ids"], row["loss_mask"])]
    first, second = "I am fine, thanks.", "The capital of France is Paris."
    assert runs == ([first, second + eot] if cut == 2 else [first + eot, second])
    assert sum(row["loss_mask"]) == sum(plain.loss_mask) - 1  # exactly one token (the end-of-turn) left out


def test_truncated_flag_kept_only_on_assistant_turns():
    record = {"conversations": [
        {"from": "human", "value": "hi", "truncated": True},
        {"from": "gpt", "value": "cut", "truncated": True},
        {"from": "human", "value": "more"},
        {"from": "gpt", "value": "done", "truncated": False},
    ]}
    messages, reason, _ = normalize_record(record)
    assert reason is None
    assert messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "cut", "truncated": True},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "done"},
    ]
