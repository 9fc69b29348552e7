"""One typed eval config: `vat eval`'s flags, run_eval's keywords and a bench's eval sections all resolve to
vat.eval.config.EvalConfig, whose defaults and choices are stated once."""

from __future__ import annotations

import dataclasses

import pytest

from vat.bench.config import BenchEvalConfig, BenchMethodEvalConfig, load_bench_config
from vat.cli import build_parser
from vat.errors import VatError
from vat.eval.config import EVAL_DEFAULTS, EVAL_FIELDS, EvalConfig, check_eval_config, eval_config
from vat.eval.run import FLAG_FIELDS, config_from_args, run_eval

# a bench's eval defaults that differ from `vat eval`'s on purpose (docs/bench.md)
BENCH_OWN_DEFAULTS = {"benchmarks", "limit", "max_new_tokens", "budgets"}


def _eval_args(*flags: str):
    return build_parser().parse_args(["eval", "--output", "out", *flags])


def test_vat_eval_flags_are_the_eval_config_fields():
    actions = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["eval"]._actions}
    flags = {FLAG_FIELDS.get(dest, dest) for dest in actions}
    assert set(EVAL_FIELDS) <= flags, set(EVAL_FIELDS) - flags  # every setting has its flag


def test_unset_flags_take_the_eval_config_defaults():
    cfg = config_from_args(_eval_args())
    for name in EVAL_FIELDS:
        if name not in ("budgets", "dtype", "experts_impl"):  # target loading flags carry the trainer's defaults
            assert getattr(cfg, name) == getattr(EVAL_DEFAULTS, name), name
    assert cfg.budgets == "none"
    assert config_from_args(_eval_args("--policy", "acceptmoe")).budgets == "auto"  # acceptmoe sizes its own set
    given = config_from_args(_eval_args("--steps", "3", "--benchmark", "a", "--benchmark", "b", "--budget", "none,8",
                                        "--ngram-rule", "recent", "--seed", "4"))
    assert (given.steps, given.benchmarks, given.budgets, given.ngram_rule, given.seed) == (3, ["a", "b"], "none,8",
                                                                                           "recent", 4)


@pytest.mark.parametrize("flags,message", [
    (("--policy", "substitue"), "--policy `substitue`: one of substitute"),
    (("--tree-policy", "evicts"), "--tree-policy `evicts`: one of confidence, evict, ecospec"),
    (("--ngram-rule", "latest"), "--ngram-rule `latest`: one of vllm, recent"),
    (("--cost-model", "b200"), "known accelerators are h100, h200, a100, l40s"),
    (("--draft-confidence", "1.5"), r"--draft-confidence must be in \(0, 1\], got 1.5"),
    (("--draft-confidence", "0.4", "--tree", "2,3,6"), "--draft-confidence stops a chain: drop --tree"),
])
def test_a_bad_choice_stops_in_one_line_before_anything_loads(flags, message):
    with pytest.raises(VatError, match=message):
        check_eval_config(config_from_args(_eval_args(*flags)))


def test_run_eval_rejects_an_unknown_setting_with_the_closest_one():
    with pytest.raises(VatError, match=r"unknown eval setting `stepz` \(did you mean `steps`\?\)"):
        run_eval(drafts=["ngram"], stepz=3)
    with pytest.raises(VatError, match="unknown eval setting"):
        eval_config(EvalConfig(), temprature=1.0)


def test_bench_eval_sections_are_eval_config_fields_with_its_defaults():
    for schema in (BenchEvalConfig, BenchMethodEvalConfig):
        names = {f.name for f in dataclasses.fields(schema)}
        assert names <= set(EVAL_FIELDS), names - set(EVAL_FIELDS)
    bench = BenchEvalConfig()
    for f in dataclasses.fields(BenchEvalConfig):
        if f.name not in BENCH_OWN_DEFAULTS:
            assert getattr(bench, f.name) == getattr(EVAL_DEFAULTS, f.name), f.name


def test_bench_sections_use_the_eval_configs_choices():
    base = ["methods.a.recipe=tiny/eagle3.yaml", "reference=a"]
    with pytest.raises(VatError, match="bench config key `eval.policy`: one of substitute"):
        load_bench_config(None, [*base, "eval.policy=substitue"])
    with pytest.raises(VatError, match="bench config key `methods.a.eval.tree_policy`: one of confidence"):
        load_bench_config(None, [*base, "methods.a.eval.tree_policy=evicts"])


def test_every_registered_eval_policy_is_consistent_with_the_config_and_the_budget_rules():
    """Each registry entry: its key is its name, it is picked by tree_policy, by policy (then a budget rule of
    vat.target.budget) or by budget_rank (then a rank of vat.target.budget), the settings it reads are EvalConfig
    fields, its eval.json keys collide with no other's, and `vat eval --help` describes it."""
    from vat.eval.policies.registry import EVAL_POLICIES, SETTINGS, policy_help
    from vat.target.budget import POLICIES, RANKS

    run_keys = [key for cls in EVAL_POLICIES.values() for key in cls.run_keys]
    settings = [field for cls in EVAL_POLICIES.values() for field in cls.settings]
    assert len(set(run_keys)) == len(run_keys) and len(set(settings)) == len(settings)
    assert set(settings) <= set(EVAL_FIELDS)
    for name, cls in EVAL_POLICIES.items():
        assert cls.name == name and cls.summary and cls.setting in SETTINGS and cls.setting in EVAL_FIELDS
        assert cls.setting == "tree_policy" or name in (POLICIES if cls.setting == "policy" else RANKS)
        assert f"{name} = {cls.summary}" in policy_help(cls.setting)[1]
    assert EVAL_DEFAULTS.tree_policy in EVAL_POLICIES
