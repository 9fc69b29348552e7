"""Python code as chats, from the interpreter's standard library: the bench target's deterministic code source.

Every function of the standard library's ``.py`` files (tests, IDLE, demos and ``site-packages`` left out) that has a
docstring becomes one chat, in the format of the HumanEval prompts vat evaluates on: the user turn is
:data:`CODE_INSTRUCTION` around the function's signature and docstring, the assistant turn is the whole function in
one Python code block. Files are read in sorted order and functions in source order, so the chats are a function of
the Python version alone, which :func:`stdlib_source` records.
"""

from __future__ import annotations

import ast
import json
import math
import os
import platform
import sysconfig
import textwrap
from collections.abc import Iterator

from vat.data_prep.readers import iter_records

# the instruction `vat eval` wraps HumanEval prompts in (vat.eval.benchmarks reads it from here)
CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
    "```python\n{prompt}```"
)
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo", "__pycache__", "ensurepip",
                "lib2to3", "pydoc_data", "tkinter"}


def stdlib_source() -> dict:
    """Where the code comes from: the stdlib directory and the Python version that ships it."""
    return {"stdlib": sysconfig.get_paths()["stdlib"], "python": platform.python_version(),
            "implementation": platform.python_implementation()}


def iter_stdlib_files(root: str | None = None) -> Iterator[str]:
    """The standard library's ``.py`` files in sorted order, skipping tests, demos and third-party packages."""
    root = root or stdlib_source()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith(("test", ".")))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test"):
                yield os.path.join(dirpath, name)


def function_chats(source: str, max_chars: int = 1500) -> list[list[dict]]:
    """One chat per function with a docstring in ``source`` (methods included), in source order.

    Args:
        source: a module's text.
        max_chars: functions longer than this are skipped (the target's rows are short).

    Returns:
        ``[[{"role": "user", ...}, {"role": "assistant", ...}], ...]``; nothing for a module that does not parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    chats = []
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in sorted(nodes, key=lambda n: n.lineno):
        doc = ast.get_docstring(node, clean=False)
        body_start = node.body[0]
        if not doc or len(node.body) < 2 or body_start.end_lineno is None or node.end_lineno is None:
            continue  # a function that is only a docstring has nothing to complete
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        whole = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))
        head = textwrap.dedent("\n".join(lines[start - 1 : body_start.end_lineno]))
        if len(whole) > max_chars or not head.strip():
            continue
        chats.append([
            {"role": "user", "content": CODE_INSTRUCTION.format(prompt=head + "\n")},
            {"role": "assistant", "content": f"```python\n{whole}\n```"},
        ])
    return chats


def read_code_chats(max_chars_total: int, heldout: int, heldout_every: int = 10, root: str | None = None,
                    max_chars: int = 1500,
                    max_train: int | None = None) -> tuple[list[list[dict]], list[list[dict]], dict]:
    """Code chats from the standard library until ``max_chars_total`` characters of training chats are read (or
    ``max_train`` training chats, with the held-out set complete).

    Every ``heldout_every``-th chat goes to the held-out set until it has ``heldout`` chats.

    Returns:
        ``(train, heldout, stats)``: stats has the source (:func:`stdlib_source`), files read and chats kept.
    """
    train: list[list[dict]] = []
    held: list[list[dict]] = []
    chars = files = kept = 0
    for path in iter_stdlib_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            chats = function_chats(f.read(), max_chars)
        files += 1
        for chat in chats:
            if kept % heldout_every == 0 and len(held) < heldout:
                held.append(chat)
            else:
                train.append(chat)
                chars += sum(len(m["content"]) for m in chat)
            kept += 1
        if (chars >= max_chars_total or (max_train is not None and len(train) >= max_train)) and len(held) >= heldout:
            break
    stats = {**stdlib_source(), "files_read": files, "chats": kept, "train_chats": len(train),
             "heldout_chats": len(held), "train_chars": chars}
    if root is not None:
        stats["stdlib"] = root
    return train, held, stats


def write_mixed_source(sharegpt: str, output: str, rows: int, code_fraction: float, *, heldout: int,
                       max_chars: int = 1500, root: str | None = None) -> dict:
    """A chat file of ``rows`` conversations: ShareGPT's first rows with standard-library code chats interleaved at
    ``code_fraction`` (row i is a code chat when floor((i + 1) f) > floor(i f)), written once as JSON Lines.

    The code chats are the training split of :func:`read_code_chats` with the bench target's held-out count, so
    the regenerated prompts never include the held-out code the build measures perplexity on; HumanEval's prompts
    are not in the standard library. Deterministic from the ShareGPT file and the Python version.

    Returns:
        ``{"rows", "code_rows", "sharegpt_rows", **stdlib_source()}``.
    """
    n_code = math.floor(rows * code_fraction)
    code, _, _ = read_code_chats(max_chars_total=1 << 62, heldout=heldout, max_chars=max_chars, max_train=n_code,
                                 root=root)
    if len(code) < n_code:
        n_code = len(code)
    tmp = output + ".tmp"
    written = code_rows = 0
    sharegpt_rows = iter_records(sharegpt)
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(rows):
            if code_rows < n_code and math.floor((i + 1) * code_fraction) > math.floor(i * code_fraction):
                f.write(json.dumps({"id": f"stdlib-{code_rows}", "messages": code[code_rows]}, ensure_ascii=False)
                        + "\n")
                code_rows += 1
            else:
                record = next(sharegpt_rows, None)
                if record is None:
                    break
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    os.replace(tmp, output)
    return {"rows": written, "code_rows": code_rows, "sharegpt_rows": written - code_rows, **stdlib_source()}
