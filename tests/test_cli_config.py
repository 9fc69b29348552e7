"""The CLI surface and the typed config: six subcommands, strict keys with suggestions, typed values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vat.cli import build_parser
from vat.cli import main as vat_main
from vat.config import load_config
from vat.errors import VatError

SUBCOMMANDS = ["prep", "profile", "train", "eval", "export", "demo"]


def test_help_lists_the_six_subcommands():
    out = subprocess.run([sys.executable, "-m", "vat", "--help"], capture_output=True, text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert f"    {name}" in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert len(capsys.readouterr().out.splitlines()) > 3


def test_unknown_key_names_the_closest(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  max_step: 3\n")
    with pytest.raises(VatError, match=r"unknown config key `train.max_step` \(did you mean `train.max_steps`\?\)"):
        load_config(str(recipe))
    with pytest.raises(VatError, match="did you mean `loss.union_weight`"):
        load_config(None, ["loss.union_weigth=0.1"])


def test_wrong_type_names_key_and_type():
    with pytest.raises(VatError, match=r"config key `train.lr`: expected float"):
        load_config(None, ["train.lr=fast"])
    with pytest.raises(VatError, match=r"config key `train.max_steps`: expected int"):
        load_config(None, ["train.max_steps=many"])


def test_overrides_and_method_presets():
    cfg = load_config(None, ["method=vat", "train.max_steps=20", "output_dir=/tmp/x", "budget.B=8"])
    assert cfg.train.max_steps == 20 and cfg.output_dir == "/tmp/x" and cfg.budget.B == 8
    assert cfg.loss.adaptive_weights is True and cfg.loss.vh_weight == 1.0 and cfg.drafter.verification_head
    ablation = load_config(None, ["method=vat", "loss.adaptive_weights=false"])
    assert ablation.loss.adaptive_weights is False and ablation.loss.vh_weight == 1.0
    base = load_config(None, ["method=eagle3"])
    assert base.loss.adaptive_weights is False and base.loss.vh_weight == 0.0


def test_cli_prints_one_line_for_user_errors(tmp_path, capsys):
    rc = vat_main(["train", str(tmp_path / "missing.yaml")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vat: error: recipe not found: {tmp_path / 'missing.yaml'}"]


def test_readme_cli_reference_is_generated_from_the_cli():
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("cli_reference", os.path.join(root, "scripts", "cli_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = open(os.path.join(root, "README.md")).read()
    block = readme.split(module.START, 1)[1].split(module.END, 1)[0].strip()
    assert block == module.reference().strip(), "README CLI reference is stale: python scripts/cli_reference.py --write"


def test_enumerated_values_are_checked_at_load_time():
    # YAML reads an unquoted `no` as false: it still means "no mixed precision"
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    with pytest.raises(VatError, match=r"`substitue` for config key `budget.policy` \(did you mean `substitute`\?\)"):
        load_config(None, ["budget.policy=substitue"])
    with pytest.raises(VatError, match="train.scheduler.*one of cosine, constant"):
        load_config(None, ["train.scheduler=linear"])


def test_config_choices_match_the_modules_that_use_them():
    from vat.config import CHOICES
    from vat.target.budget import POLICIES, SCOPES, TRAINING_POLICIES
    from vat.target.model import EXPERTS_IMPLS
    from vat.verify import ACCEPTANCE_RULES

    # a training recipe takes MoE-Spec's policies; AcceptMoE (eval only) is refused at load in one line
    assert CHOICES["budget.policy"] == TRAINING_POLICIES and set(POLICIES) - set(TRAINING_POLICIES) == {"acceptmoe"}
    assert CHOICES["budget.scope"] == SCOPES
    with pytest.raises(VatError, match="`acceptmoe` for config key `budget.policy`"):
        load_config(None, ["budget.policy=acceptmoe"])
    assert CHOICES["target.experts_impl"] == EXPERTS_IMPLS and CHOICES["loss.acceptance"] == ACCEPTANCE_RULES


def test_thread_policy_sets_threads_and_passive_waits(monkeypatch, capsys):
    import os

    import torch

    from vat.cli import apply_thread_policy, main

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    try:
        apply_thread_policy(1)
        assert torch.get_num_threads() == 1 and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        monkeypatch.setenv("VAT_THREADS", "2")
        apply_thread_policy(None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert main(["--threads", "0", "export", "x", "--format", "sglang", "--output", "y"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    monkeypatch.setenv("VAT_THREADS", "many")
    assert main(["export", "x", "--format", "sglang", "--output", "y"]) == 2
    assert "$VAT_THREADS must be a positive integer" in capsys.readouterr().err
