"""`train.lora`: peft adapters on an imported EAGLE-3 draft; only adapters, the VH (and fc when asked) train; every
draft directory vat writes holds the merged weights in the original layout, equal to the adapted model's output."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from helpers import read_metrics, train_config

from vat.errors import VatError
from vat.train.trainer import Trainer
from vat.train.trainer import main as train_main


@pytest.fixture(scope="module")
def source(train_workspace, tmp_path_factory):
    """A vat EAGLE-3 draft for the tiny target (full vocabulary), the draft a LoRA run imports."""
    from transformers import AutoConfig

    from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from vat.export import save_draft

    tc = AutoConfig.from_pretrained(train_workspace["target"])
    cfg = Eagle3Config.for_target(tc, draft_vocab_size=tc.vocab_size, ttt_steps=3)
    torch.manual_seed(5)
    return save_draft(Eagle3Drafter(cfg), cfg, str(tmp_path_factory.mktemp("lora_src") / "draft"))


def _lora(ws, src, out, *extra):
    return train_config(ws, out, f"train.init_from={src}", "method=vat", "drafter.ttt_steps=3", "train.lora.r=4",
                        "train.lora.alpha=8", "train.lr=1e-2", "train.save_every=0", *extra)


def _first_batch(trainer):
    from vat.train.data import collate

    indices = trainer.batches.epoch(0)[0]
    batch = collate([trainer.dataset[i] for i in indices], trainer.pad_id)
    return {k: v.to(trainer.device) for k, v in batch.items()}


@pytest.mark.parametrize("train_fc", [False, True])
def test_lora_gradients_reach_only_adapters_vh_and_fc_when_asked(train_workspace, source, tmp_path, train_fc):
    from safetensors.torch import load_file

    trainer = Trainer(_lora(train_workspace, source, str(tmp_path / "run"), f"train.lora.train_fc={train_fc}"))
    trainer.setup()
    try:
        drafter = trainer.accelerator.unwrap_model(trainer.drafter)
        loss, _ = trainer.forward_loss(_first_batch(trainer), None)
        trainer.accelerator.backward(loss)
        expected = {n for n, _ in drafter.named_parameters()
                    if ".lora_" in n or n.startswith("verification_head.") or (train_fc and n.startswith("fc."))}
        with_grad = {n for n, p in drafter.named_parameters() if p.grad is not None}
        trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
        assert with_grad == expected == trainable
        assert any(".lora_A." in n for n in expected) and any(n.startswith("midlayer.mlp.down_proj") for n in expected)
        nonzero = {n for n in with_grad if dict(drafter.named_parameters())[n].grad.abs().sum() > 0}
        assert any(".lora_B." in n for n in nonzero) and ("fc.weight" in nonzero) == train_fc
        assert not any(n.startswith(("lm_head", "norm", "midlayer.hidden_norm")) for n in with_grad)
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.run()
    finally:
        trainer.close()
    # every frozen weight leaves the run exactly as imported; the adapted layers changed (merged in final/)
    before, after = load_file(os.path.join(source, "model.safetensors")), load_file(
        os.path.join(tmp_path / "run", "final", "model.safetensors"))
    assert set(before) == set(after)  # the original layout: no base_layer / lora_ names
    for name, value in before.items():
        adapted = name.startswith("midlayer.") and name.endswith("_proj.weight")
        if adapted or (train_fc and name == "fc.weight"):
            assert not torch.equal(value, after[name]), name
        else:
            assert torch.equal(value, after[name]), name


def test_lora_merged_exports_equal_the_adapted_model(train_workspace, source, tmp_path):
    """After training, final/ (merged), its SGLang and speculators exports and peft's own merge_and_unload all give
    the adapted (unmerged) model's logits."""
    from vat.export import export_sglang, export_speculators, load_draft
    from vat.train.lora import lora_modules, merged_state_dict

    out = tmp_path / "run"
    trainer = Trainer(_lora(train_workspace, source, str(out), "train.max_steps=3", "train.lora.dropout=0.1"))
    trainer.setup()
    try:
        trainer.run()
        adapted = trainer.accelerator.unwrap_model(trainer.drafter).eval()
        batch = _first_batch(trainer)
        tout = trainer.target.forward(batch["input_ids"], attention_mask=batch["attention_mask"])
        embed = trainer.target.embed_tokens().weight.detach()
        with torch.no_grad():
            reference = adapted(tout.aux_hidden, batch["input_ids"], batch["attention_mask"], ttt_steps=3)
            assert any(m.lora_B["default"].weight.abs().sum() > 0 for n, m in adapted.named_modules()
                       if hasattr(m, "lora_B"))  # the adapters moved: the merge is not trivially the base
            drafts = {"final": load_draft(str(out / "final"), embed_weight=embed)[0]}
            drafts["sglang"] = load_draft(export_sglang(drafts["final"], str(tmp_path / "sg")), embed_weight=embed)[0]
            spec = export_speculators(drafts["final"], str(tmp_path / "spec"), target=train_workspace["target"])
            drafts["speculators"] = load_draft(spec, embed_weight=embed)[0]
            for name, draft in drafts.items():
                got = draft.eval()(tout.aux_hidden, batch["input_ids"], batch["attention_mask"], ttt_steps=3)
                torch.testing.assert_close(got.logits, reference.logits, rtol=1e-5, atol=1e-5, msg=name)
                torch.testing.assert_close(got.vh_logits, reference.vh_logits, rtol=1e-5, atol=1e-5, msg=name)
            # vat's merge is peft's: LoraLayer.merge (what merge_and_unload runs per layer) on a copy gives the same
            ours, twin = merged_state_dict(adapted), copy.deepcopy(adapted)
            layers = lora_modules(twin)
            assert len(layers) == 7
            for name, layer in layers.items():
                layer.merge()
                torch.testing.assert_close(ours[f"{name}.weight"], layer.get_base_layer().weight, rtol=1e-6,
                                           atol=1e-7, msg=name)
    finally:
        trainer.close()
    assert json.load(open(out / "final" / "config.json"))["vat_format"] == "eagle3"


def test_lora_resume_continues_the_adapters_exactly(train_workspace, source, tmp_path):
    """Checkpoints keep the unmerged adapters (and the dropout RNG): a killed LoRA run resumes to the same numbers."""
    lora = ("train.lora.dropout=0.1", "train.max_steps=4", "train.save_every=2")
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    train_main(_lora(train_workspace, source, full, *lora))
    train_main(_lora(train_workspace, source, killed, *lora, "train.stop_after=2"))
    state = torch.load(os.path.join(killed, "checkpoints", "step_2", "trainer_state.pt"), weights_only=False)
    assert any(".lora_B.default." in k for k in state["drafter"]) and state["lora_targets"]
    train_main(_lora(train_workspace, source, killed, *lora, "resume=auto"))
    a, b = read_metrics(full), read_metrics(killed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("loss", "tau_sim", "vh_bce", "lr", "grad_norm", "vh_grad_norm"):
            assert ra[key] == rb[key], (ra["step"], key)
    # resuming without the adapters is refused in one line
    with pytest.raises(VatError, match="trained with LoRA on .* resume with the same train.lora"):
        train_main(train_config(train_workspace, killed, f"train.init_from={source}", "method=vat",
                                "drafter.ttt_steps=3", "train.max_steps=4", "resume=auto", "logging.progress=false"))


def test_lora_bad_targets_fail_in_one_line(train_workspace, source, tmp_path):
    with pytest.raises(VatError, match=r"^train.lora.target_modules \['nope'\] match no Linear layer"):
        train_main(_lora(train_workspace, source, str(tmp_path / "a"), "train.lora.target_modules=[nope]"))
    with pytest.raises(VatError, match=r"^train.lora.target_modules adapt \['fc'\], which train in full"):
        train_main(_lora(train_workspace, source, str(tmp_path / "b"), "train.lora.target_modules=[fc]",
                               "train.lora.train_fc=true"))
    from vat.config import load_config

    with pytest.raises(VatError, match=r"^config key `train.lora` needs `train.init_from`"):
        load_config(None, ["train.lora.r=8"])
