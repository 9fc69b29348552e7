"""The bench target's code source: standard-library functions as HumanEval-format chats, their held-out split, and
the regen source that interleaves them with ShareGPT rows."""

from __future__ import annotations

import json

from vat.data_prep.code_chats import CODE_INSTRUCTION, function_chats, read_code_chats, write_mixed_source

MODULE = '''
def add(a, b):
    """Return a + b."""
    return a + b


def only_doc():
    """Nothing to complete."""


class Box:
    def size(self):
        """How many items."""
        return len(self.items)
'''


def _stdlib(tmp_path, files: int = 6):
    root = tmp_path / "lib"
    root.mkdir()
    for i in range(files):
        (root / f"mod{i}.py").write_text(MODULE.replace("add", f"add{i}"))
    (root / "test_skipped.py").write_text(MODULE)
    return str(root)


def test_functions_with_docstrings_become_humaneval_format_chats():
    chats = function_chats(MODULE)
    assert len(chats) == 2  # a docstring-only function has nothing to complete
    user, answer = chats[0]
    assert user["content"] == CODE_INSTRUCTION.format(prompt='def add(a, b):\n    """Return a + b."""\n')
    assert answer["content"].startswith("```python\ndef add(a, b):") and answer["content"].endswith("return a + b\n```")
    assert chats[1][1]["content"].startswith("```python\ndef size(self):")  # methods dedented
    assert function_chats("def broken(:\n") == []


def test_held_out_chats_are_every_tenth_until_enough(tmp_path):
    root = _stdlib(tmp_path)
    train, held, stats = read_code_chats(1 << 40, heldout=1, heldout_every=3, root=root)
    assert stats["chats"] == 12 and stats["files_read"] == 6 and len(held) == 1 and len(train) == 11
    assert held[0] == function_chats(MODULE.replace("add", "add0"))[0]  # the first chat: index 0 of every 3rd
    few, _, _ = read_code_chats(1 << 40, heldout=1, heldout_every=3, root=root, max_train=3)
    assert len(few) >= 3 and few[:3] == train[:3]  # stops once enough, in the same order


def test_mixed_regen_source_interleaves_code_at_the_fraction(tmp_path):
    root = _stdlib(tmp_path)
    sharegpt = tmp_path / "sharegpt.json"
    rows = [{"id": f"sg{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(20)]
    sharegpt.write_text(json.dumps(rows))
    out = tmp_path / "mixed.jsonl"
    stats = write_mixed_source(str(sharegpt), str(out), 10, 0.3, heldout=1, root=root)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert stats["rows"] == 10 and stats["code_rows"] == 3 and stats["sharegpt_rows"] == 7
    ids = [r["id"] for r in lines]
    assert ids == ["sg0", "sg1", "sg2", "stdlib-0", "sg3", "sg4", "stdlib-1", "sg5", "sg6", "stdlib-2"]
    held = read_code_chats(1 << 40, heldout=1, root=root)[1]
    assert all(r["messages"] not in held for r in lines if r["id"].startswith("stdlib"))  # held-out code stays out
    write_mixed_source(str(sharegpt), str(tmp_path / "again.jsonl"), 10, 0.3, heldout=1, root=root)
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()  # deterministic
