"""The natural greedy decode of a benchmark's prompts, kept on disk between evaluations (docs/eval.md).

The quality figures of a budgeted run compare it with the target's natural greedy output of the same prompts. That
output depends on the target, its dtype / device / experts implementation, the tokenizer, the prompts and the token
limits, never on the draft: a `vat bench` that evaluates fifteen drafts under budgets would otherwise decode it
fifteen times (an AR pass of every prompt, ~4 CPU-minutes per 240 tiny-target prompts). With a cache directory
(``vat eval --reference-cache DIR``; `vat bench` uses ``<bench dir>/natural_reference``) every greedy run at natural
routing — the AR pass, or any draft at budget ``none``, which greedy speculative decoding makes lossless — stores it,
and a later run of the same key reads it instead of decoding.

Files: ``<dir>/<key>.json`` = ``{"key_parts": ..., "prompts": [{"question_id", "category", "prompt_ids",
"token_ids"}]}`` with one ``prompt_ids`` / ``token_ids`` list per turn. A damaged file is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from vat.eval.engine import Generation
from vat.eval.metrics import PromptRun

CACHE_FORMAT = 1


def target_files_identity(path: str | None) -> dict:
    """What identifies a target directory's weights: its real path, its config's hash, its weight files' sizes and
    modification times (a hub name, or a model given as an object, is identified by its name alone)."""
    if not path or not os.path.isdir(path):
        return {"name": path}
    files = {}
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if name == "config.json":
            with open(file, "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()[:16]
        elif name.endswith((".safetensors", ".bin")):
            stat = os.stat(file)
            files[name] = [stat.st_size, int(stat.st_mtime)]
    return {"path": os.path.realpath(path), "files": files}


def reference_key(target: Any, tokenizer: Any, benchmark: str, prompts: Sequence, *, max_new_tokens: int,
                  eos: Sequence[int] | int | None) -> tuple[str, dict]:
    """The cache key of one benchmark's natural greedy reference and the parts it hashes.

    Args:
        target: the loaded :class:`~vat.target.FrozenTarget` (``path``, ``dtype``, ``device``, ``experts_impl``).
        tokenizer: the tokenizer the prompts are rendered with.
        benchmark: the benchmark's name in the eval.
        prompts: the benchmark's prompts that run (``question_id`` and ``turns`` of each).
        max_new_tokens: tokens generated per turn.
        eos: the end-of-sequence ids.
    """
    parts = {
        "format": CACHE_FORMAT,
        "target": target_files_identity(getattr(target, "path", None)),
        "dtype": str(target.dtype), "device": target.device.type,
        "experts_impl": getattr(target, "experts_impl", None),
        "tokenizer": [getattr(tokenizer, "name_or_path", None), len(tokenizer)],
        "benchmark": benchmark,
        "prompts": hashlib.sha256(json.dumps([[str(p.question_id), list(p.turns)] for p in prompts]).encode())
        .hexdigest(),
        "max_new_tokens": max_new_tokens,
        "eos": sorted(eos) if isinstance(eos, (list, tuple, set)) else eos,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24], parts


def load_reference(directory: str, key: str) -> list[PromptRun] | None:
    """The cached reference of ``key`` as :class:`PromptRun` s (token ids and prompts only), None when absent or
    unreadable."""
    file = os.path.join(directory, f"{key}.json")
    try:
        with open(file) as f:
            data = json.load(f)
        return [PromptRun(p["question_id"], p["category"],
                          [Generation(list(ids), [], 0, 0.0, len(prompt)) for ids, prompt in
                           zip(p["token_ids"], p["prompt_ids"])],
                          [list(ids) for ids in p["prompt_ids"]]) for p in data["prompts"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_reference(directory: str, key: str, parts: dict, runs: Sequence[PromptRun]) -> str:
    """Write the reference of ``key`` (atomically: a killed run leaves no half file); returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    file = os.path.join(directory, f"{key}.json")
    data = {"key_parts": parts, "prompts": [
        {"question_id": r.question_id, "category": r.category, "prompt_ids": [list(p) for p in r.prompt_ids],
         "token_ids": [list(g.token_ids) for g in r.turns]} for r in runs]}
    tmp = f"{file}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, file)
    return file
