"""Draft checkpoints and engine exports: every config key and weight name of the vat, SGLang and speculators layouts,
the aux-layer off-by-one, and export -> load -> identical logits for each format (docs/export.md is the contract)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from helpers import HT, VD, H, V, eagle3_batch, eagle3_config, random_eagle3
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vat.drafters.eagle3 import Eagle3Drafter
from vat.errors import VatError
from vat.export import (
    detect_format,
    export_draft,
    export_sglang,
    export_speculators,
    load_draft,
    save_draft,
    sglang_to_vat_aux_ids,
    vat_to_hf_hidden_states_index,
    vat_to_sglang_aux_ids,
    vat_to_vllm_aux_ids,
    vllm_to_vat_aux_ids,
)

MIDLAYER = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]
TOP = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
LLAMA_KEYS = {
    "model_type": "llama",
    "hidden_size": H,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "vocab_size": V,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}
# the norm placement flags of the default test draft, as both engine formats write them
NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def keys_of(path: str) -> set[str]:
    with safe_open(path, "pt") as f:
        return set(f.keys())


def read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def same_logits(a: Eagle3Drafter, b: Eagle3Drafter) -> None:
    aux, ids = eagle3_batch(B=2, T=8)
    aux = torch.randn(2, 8, 3 * a.config.target_hidden_size, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        x, y = a.ttt_forward(aux, ids, mask, ttt_steps=3), b.ttt_forward(aux, ids, mask, ttt_steps=3)
    assert torch.equal(x.logits, y.logits)
    assert (x.vh_logits is None) == (y.vh_logits is None)
    if x.vh_logits is not None:
        assert torch.equal(x.vh_logits, y.vh_logits)


@pytest.fixture
def trained(tmp_path):
    """A draft with a verification head and target_hidden_size != hidden_size, saved as a vat checkpoint; its target
    directory holds a config and the input embedding (what a speculators export ships)."""
    cfg = eagle3_config(verification_head=True, target_path=str(tmp_path / "target"))
    os.makedirs(tmp_path / "target")
    with open(tmp_path / "target" / "config.json", "w") as f:
        json.dump({"architectures": ["OlmoeForCausalLM"]}, f)
    model = random_eagle3(cfg)
    save_file({"model.embed_tokens.weight": model.embed_tokens.weight.contiguous(), "lm_head.weight": torch.zeros(V, H)},
              str(tmp_path / "target" / "model.safetensors"))
    ckpt = save_draft(model, cfg, str(tmp_path / "ckpt"))
    return model, ckpt, tmp_path


# ----------------------------------------------------------------------------------------------------------------------
# Conventions
# ----------------------------------------------------------------------------------------------------------------------


def test_aux_layer_conventions_off_by_one():
    vat_ids = [1, 15, 28]  # EAGLE-3 default for a 32-layer target, 0-indexed layer outputs
    assert vat_to_sglang_aux_ids(vat_ids) == [1, 15, 28]  # SGLang config ids name layer outputs too
    assert vat_to_vllm_aux_ids(vat_ids) == [2, 16, 29]  # vLLM names the layer whose input it captures
    assert vat_to_hf_hidden_states_index(vat_ids) == [2, 16, 29]
    assert vllm_to_vat_aux_ids([2, 16, 29]) == vat_ids and sglang_to_vat_aux_ids([1, 15, 28]) == vat_ids


# ----------------------------------------------------------------------------------------------------------------------
# vat checkpoint
# ----------------------------------------------------------------------------------------------------------------------


def test_vat_checkpoint_layout_and_round_trip(trained):
    model, ckpt, _ = trained
    assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors", "verification_head.safetensors"]
    config = read(os.path.join(ckpt, "config.json"))
    expected = {"vat_format": "eagle3", "vat_format_version": 1, **model.config.to_dict()}
    expected.update(
        aux_layer_convention="layer_output_0_indexed",
        aux_layer_ids_sglang=[1, 3, 4],
        aux_layer_ids_vllm=[2, 4, 5],
        torch_dtype="float32",
    )
    note = config.pop("aux_layer_convention_note")
    assert "OUTPUTS" in note and "id + 1" in note
    assert config == expected
    assert config["aux_layer_ids"] == [1, 3, 4] and config["target_path"] == model.config.target_path
    assert keys_of(os.path.join(ckpt, "model.safetensors")) == set(TOP) | {f"midlayer.{k}" for k in MIDLAYER}
    assert keys_of(os.path.join(ckpt, "verification_head.safetensors")) == {
        "verification_head.weight",
        "verification_head.bias",
    }
    loaded, cfg = load_draft(ckpt, model.embed_tokens.weight)
    assert cfg == model.config and not loaded.training
    assert loaded.embed_tokens.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # shared, not copied
    same_logits(model, loaded)
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)


def test_save_without_head_removes_stale_head_and_bf16_round_trip(trained):
    _, ckpt, _ = trained
    plain = random_eagle3(eagle3_config()).to(torch.bfloat16)
    save_draft(plain, None, ckpt)  # same directory: the old verification head must go
    assert not os.path.exists(os.path.join(ckpt, "verification_head.safetensors"))
    assert read(os.path.join(ckpt, "config.json"))["torch_dtype"] == "bfloat16"
    loaded, cfg = load_draft(ckpt, plain.embed_tokens.weight)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.long and not cfg.verification_head
    same_logits(plain, loaded)


# ----------------------------------------------------------------------------------------------------------------------
# SGLang
# ----------------------------------------------------------------------------------------------------------------------


def export_trained(trained, fmt: str, name: str):
    """Export the trained checkpoint to ``fmt`` under ``name``: (out dir, its config less the vat block, the vat block),
    after checking the export wrote the config, the weights and the verification head."""
    _, ckpt, tmp = trained
    out = export_draft(ckpt, fmt, str(tmp / name))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "verification_head.safetensors"]
    config = read(os.path.join(out, "config.json"))
    return out, config, config.pop("vat")


def round_trip_logits(model, out: str, fmt: str) -> None:
    """An export in ``out`` is detected as ``fmt`` and loads back to ``model``'s config and logits."""
    assert detect_format(read(os.path.join(out, "config.json"))) == fmt
    loaded, cfg = load_draft(out, model.embed_tokens.weight)
    assert cfg == model.config
    same_logits(model, loaded)


def test_sglang_export_every_key(trained):
    out, config, vat_block = export_trained(trained, "sglang", "sglang")
    expected = {"architectures": ["LlamaForCausalLMEagle3"], **LLAMA_KEYS}
    expected.update(
        draft_vocab_size=VD,
        target_hidden_size=HT,  # differs from hidden_size, so it is written
        **NORM_FLAGS,
        eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
    )
    assert config == expected
    assert vat_block["aux_layer_ids"] == [1, 3, 4] and vat_block["aux_layer_convention"] == "layer_output_0_indexed"
    assert vat_block["num_target_layers"] == 8 and vat_block["ttt_steps"] == 3
    assert vat_block["verification_head_file"] == "verification_head.safetensors"
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert set(weights) == set(TOP) | {f"midlayer.{k}" for k in MIDLAYER}
    assert not any("embed" in k for k in weights)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * H)  # q/k/v read the 2H concat
    assert weights["midlayer.self_attn.k_proj.weight"].shape == (2 * 16, 2 * H)
    assert weights["fc.weight"].shape == (H, 3 * HT)
    assert weights["lm_head.weight"].shape == (VD, H)
    assert weights["d2t"].dtype == torch.int64 and weights["d2t"].shape == (VD,)
    assert weights["t2d"].dtype == torch.bool and weights["t2d"].shape == (V,)
    assert torch.equal(weights["d2t"] + torch.arange(VD), torch.nonzero(weights["t2d"]).flatten())  # SGLang hot ids


def test_sglang_config_parses_as_llama_and_omits_equal_target_hidden(tmp_path):
    from transformers import LlamaConfig

    model = random_eagle3(eagle3_config(target_hidden_size=None))
    out = export_sglang(model, str(tmp_path / "s"))
    config = read(os.path.join(out, "config.json"))
    assert "target_hidden_size" not in config  # equal to hidden_size
    llama = LlamaConfig(**{k: v for k, v in config.items() if k != "vat"})
    assert (llama.hidden_size, llama.num_hidden_layers, llama.vocab_size, llama.draft_vocab_size) == (H, 1, V, VD)
    rope = getattr(llama, "rope_parameters", None) or {"rope_theta": llama.rope_theta}
    assert rope["rope_theta"] == 10000.0
    assert llama.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    loaded, _ = load_draft(out, model.embed_tokens.weight)
    same_logits(model, loaded)


def test_sglang_round_trip_identical_logits(trained):
    model, ckpt, tmp = trained
    round_trip_logits(model, export_draft(ckpt, "sglang", str(tmp / "sglang")), "sglang")


# ----------------------------------------------------------------------------------------------------------------------
# speculators (vLLM)
# ----------------------------------------------------------------------------------------------------------------------


def test_speculators_export_every_key(trained):
    model = trained[0]
    out, config, vat_block = export_trained(trained, "speculators", "spec")
    assert config == {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": VD,
        "target_hidden_size": HT,
        **NORM_FLAGS,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],  # vLLM convention: vat id + 1
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": model.config.target_path, "architectures": ["OlmoeForCausalLM"]},
        },
        "transformer_layer_config": LLAMA_KEYS,
        "torch_dtype": "float32",
    }
    assert vat_block["aux_layer_ids"] == [1, 3, 4]  # labelled vat ids next to the vLLM ones
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert set(weights) == set(TOP) | {f"layers.0.{k}" for k in MIDLAYER} | {"embed_tokens.weight"}
    # the target's table, read from the target directory (speculators' from_pretrained zero-fills a missing one)
    assert torch.equal(weights["embed_tokens.weight"], model.embed_tokens.weight)
    assert keys_of(os.path.join(out, "verification_head.safetensors")) == {
        "verification_head.weight",
        "verification_head.bias",
    }


def test_speculators_round_trip_identical_logits(trained):
    model, ckpt, tmp = trained
    out = export_draft(ckpt, "speculators", str(tmp / "spec"))
    round_trip_logits(model, out, "speculators")
    # and onward: speculators -> sglang -> vat model, still identical
    again, _ = load_draft(export_draft(out, "sglang", str(tmp / "sg2")), model.embed_tokens.weight)
    same_logits(model, again)


@pytest.mark.parametrize(
    "flags,extra",
    [
        (dict(norm_before_residual=True), set()),
        (dict(fc_norm=True), {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}),
        (dict(norm_before_fc=True), {"input_norm.weight"}),
    ],
    ids=["norm_before_residual", "fc_norm", "norm_before_fc"],
)
def test_norm_flags_round_trip_both_formats(tmp_path, flags, extra):
    model = random_eagle3(eagle3_config(**flags))
    for fmt, export in (("sglang", export_sglang), ("speculators", export_speculators)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = export(model, str(tmp_path / fmt))
        if fmt == "sglang" or not flags.get("norm_before_residual"):
            assert any(next(iter(flags)) in str(w.message) for w in caught)  # engines that may ignore it: warned
        config = read(os.path.join(out, "config.json"))
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm"):
            assert config[flag] == flags.get(flag, False)
        assert extra <= keys_of(os.path.join(out, "model.safetensors"))
        loaded, cfg = load_draft(out, model.embed_tokens.weight)
        assert cfg == model.config
        same_logits(model, loaded)


# ----------------------------------------------------------------------------------------------------------------------
# Third-party checkpoints and bad input
# ----------------------------------------------------------------------------------------------------------------------


def test_foreign_sglang_and_speculators_checkpoints_load(tmp_path):
    """Configs as SpecForge / speculators write them (no vat block); engine defaults apply."""
    model = random_eagle3(eagle3_config(target_hidden_size=None, aux_layer_ids=None, num_target_layers=None))
    state = {k: v for k, v in model.state_dict().items()}
    llama = {k: v for k, v in LLAMA_KEYS.items() if k not in ("head_dim", "rope_scaling", "pad_token_id")}
    sg = tmp_path / "specforge"
    sg.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"], **llama, "draft_vocab_size": VD}
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}
    json.dump(config, open(sg / "config.json", "w"))
    save_file(
        {f"model.{k}" if k.startswith("midlayer") else k: v for k, v in state.items()}, str(sg / "model.safetensors")
    )
    loaded, cfg = load_draft(str(sg), model.embed_tokens.weight)
    assert cfg.aux_layer_ids == [1, 15, 28] and not cfg.norm_before_residual
    same_logits(model, loaded)

    sp = tmp_path / "speculators"
    sp.mkdir()
    json.dump(
        {
            "speculators_model_type": "eagle3",
            "draft_vocab_size": VD,
            "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
            "speculators_config": {
                "proposal_methods": [{"speculative_tokens": 5}],
                "verifier": {"name_or_path": "x/y"},
            },
            "transformer_layer_config": llama,
        },
        open(sp / "config.json", "w"),
    )
    renamed = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    renamed["embed_tokens.weight"] = model.embed_tokens.weight  # speculators may ship it: ignored
    save_file(renamed, str(sp / "model.safetensors"))
    _, cfg = load_draft(str(sp))
    assert cfg.aux_layer_ids == [1, 15, 28]  # vLLM ids - 1
    assert cfg.norm_before_residual  # vLLM's loader default when the key is absent
    assert (cfg.ttt_steps, cfg.target_path) == (5, "x/y")


def test_bad_checkpoints_stop_with_one_line(tmp_path, trained):
    model, ckpt, _ = trained
    with pytest.raises(VatError, match="not found"):
        load_draft(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(VatError, match="file not found"):
        load_draft(str(tmp_path / "empty"))
    with pytest.raises(VatError, match="not an EAGLE-3 draft"):
        detect_format({"architectures": ["OlmoeForCausalLM"]})

    out = export_speculators(model, str(tmp_path / "spec"))
    config = read(os.path.join(out, "config.json"))
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # someone "fixed" the ids in vat's convention
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(VatError, match="aux layers disagree"):
        load_draft(out)

    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    del weights["d2t"]
    save_file(weights, os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(VatError, match="no d2t/t2d mapping"):
        load_draft(ckpt)
    weights["d2t"] = torch.zeros(VD + 1, dtype=torch.long)
    save_file(weights, os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(VatError, match="do not fit its config"):
        load_draft(ckpt)

    config = read(os.path.join(ckpt, "config.json"))
    config["draft_vocab_sze"] = 1
    json.dump(config, open(os.path.join(ckpt, "config.json"), "w"))
    with pytest.raises(VatError, match="did you mean 'draft_vocab_size'"):
        load_draft(ckpt)


def test_cli_export(trained, capsys):
    from vat.cli import main

    _, ckpt, tmp = trained
    assert main(["export", ckpt, "--format", "speculators", "--output", str(tmp / "cli")]) == 0
    assert "speculators" in capsys.readouterr().out
    assert read(str(tmp / "cli" / "config.json"))["speculators_model_type"] == "eagle3"
    assert main(["export", ckpt, "--format", "dflash", "--output", str(tmp / "d")]) == 2
    assert "--format dflash needs a DFlash draft" in capsys.readouterr().err  # an EAGLE-3 draft has no DFlash layout
    assert main(["export", ckpt, "--format", "sglang", "--output", ckpt]) == 2
    assert main(["export", str(tmp / "missing"), "--format", "sglang", "--output", str(tmp / "x")]) == 2
    # --target: where the embedding comes from when the recorded target_path has moved
    moved = tmp / "moved-target"
    os.rename(tmp / "target", moved)
    capsys.readouterr()
    assert main(["export", ckpt, "--format", "speculators", "--output", str(tmp / "cli2")]) == 2
    assert "target" in capsys.readouterr().err
    assert main(["export", ckpt, "--format", "speculators", "--output", str(tmp / "cli2"), "--target", str(moved)]) == 0
    from safetensors.torch import load_file

    shipped = load_file(str(tmp / "cli2" / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(shipped, load_file(str(moved / "model.safetensors"))["model.embed_tokens.weight"])
