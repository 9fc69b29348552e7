"""`vat prep capture` and `data.capture`: the capture's layout and resume, training from a capture equal to online
training (losses, gradients, weights), and bad input stopped in one line before anything trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import read_metrics, train_config, train_overrides
from safetensors.torch import load_file, save_file
from tiny_models import FAMILIES, randomized_routing, save_tiny_target, tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from vat.cli import main as vat_main
from vat.config import load_config
from vat.data_prep.capture import capture, target_identity
from vat.data_prep.capture_store import MANIFEST, CaptureReader, read_manifest, routing_dtype, write_manifest
from vat.errors import VatError
from vat.target import load_target
from vat.target.captured import load_captured_target
from vat.train.trainer import Trainer
from vat.train.trainer import main as train_main

pytestmark = pytest.mark.usefixtures("one_thread")

# the VAT recipe with the union term on (its scale measured over 2 steps), 5 steps
VAT = ("method=vat", "loss.union_weight=0.1", "loss.union_scale_warmup=2", "drafter.ttt_steps=3", "train.max_steps=5",
       "train.save_every=0")
SHARD_TOKENS = 1500  # several shards over the workspace's data


@pytest.fixture(scope="module")
def captured(train_workspace):
    """The workspace's data captured from its target (fp32 on CPU) in several shards."""
    out = str(train_workspace["root"] / "capture")
    capture(train_workspace["target"], train_workspace["data"], out, shard_tokens=SHARD_TOKENS, progress=False)
    return out


def test_capture_layout_manifest_and_resume(train_workspace, captured, tmp_path):
    manifest = read_manifest(captured)
    assert manifest["complete"] and len(manifest["shards"]) >= 3
    target = manifest["target"]
    assert (target["model_type"], target["hidden_size"], target["num_layers"], target["num_experts"]) == ("olmoe", 64, 2, 8)
    assert manifest["tokens"] == sum(manifest["lengths"]) == sum(s["tokens"] for s in manifest["shards"])
    assert [s["start"] for s in manifest["shards"][1:]] == [s["end"] for s in manifest["shards"][:-1]]
    first = load_file(os.path.join(captured, manifest["shards"][0]["file"]))
    row, n = manifest["rows"][0], manifest["lengths"][0]
    assert first[f"aux.{row}"].shape == (n, 3 * 64) and first[f"last.{row}"].shape == (n, 64)
    assert first[f"routing.{row}"].shape == (n, 2, 2) and first[f"routing.{row}"].dtype == torch.uint8
    # a kill after shard 1: the rerun keeps shards 0-1 and writes the rest, the same bytes
    copy = str(tmp_path / "killed")
    shutil.copytree(captured, copy)
    cut = read_manifest(copy)
    for shard in cut["shards"][2:]:
        os.remove(os.path.join(copy, shard["file"]))
    kept_mtime = os.path.getmtime(os.path.join(copy, cut["shards"][0]["file"]))
    cut.update(shards=cut["shards"][:2], complete=False)
    write_manifest(copy, cut)
    assert vat_main(["prep", "capture", "--target", train_workspace["target"], "--data", train_workspace["data"],
                     "--output", copy, "--shard-tokens", str(SHARD_TOKENS), "--no-progress"]) == 0
    resumed = read_manifest(copy)
    assert resumed["complete"] and [s["file"] for s in resumed["shards"]] == [s["file"] for s in manifest["shards"]]
    assert os.path.getmtime(os.path.join(copy, cut["shards"][0]["file"])) == kept_mtime
    last = manifest["shards"][-1]["file"]
    a, b = load_file(os.path.join(captured, last)), load_file(os.path.join(copy, last))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(VatError, match="other settings"):  # the same directory, another shard size
        capture(train_workspace["target"], train_workspace["data"], copy, shard_tokens=999, progress=False)


def _gradients(cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss and the draft's parameter gradients, through the trainer's own step code."""
    trainer = Trainer(cfg)
    trainer.setup()
    try:
        _, batch = trainer.next_batch()
        loss, _ = trainer.forward_loss(batch, trainer.step_context(0))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.drafter.named_parameters() if p.grad is not None}
    finally:
        trainer.close()


def _close(online: dict, captured: dict, key: str) -> None:
    """One logged metric of a run from a capture equal to the online run's within 1e-5 (null in both: a ratio with
    nothing to count, e.g. an AUC over one class)."""
    if online[key] is None:
        assert captured[key] is None, (online["step"], key)
    else:
        assert captured[key] == pytest.approx(online[key], abs=1e-5, rel=1e-5), (online["step"], key)


def test_training_from_a_capture_equals_online_training(train_workspace, captured, tmp_path):
    online, offline = str(tmp_path / "online"), str(tmp_path / "capture")
    train_main(train_config(train_workspace, online, *VAT))
    train_main(train_config(train_workspace, offline, *VAT, f"data.capture={captured}"))
    a, b = read_metrics(online), read_metrics(offline)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert a[-1]["union_scale"] > 0  # the union term pulled on the last steps
    for ra, rb in zip(a, b):
        assert ra["tokens"] == rb["tokens"]  # the same batches
        for key in ("loss", "tau_sim", "acc_0", "acc_2", "vh_bce", "vh_auc", "union_sim", "union_scale",
                    "grad_norm", "vh_grad_norm"):
            _close(ra, rb, key)
    wa = load_file(os.path.join(online, "final", "model.safetensors"))
    wb = load_file(os.path.join(offline, "final", "model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=1e-5, rtol=1e-5, msg=key)
    # the first step's gradients, parameter by parameter
    loss_a, grads_a = _gradients(train_config(train_workspace, str(tmp_path / "g_online"), *VAT))
    loss_b, grads_b = _gradients(train_config(train_workspace, str(tmp_path / "g_capture"), *VAT,
                                              f"data.capture={captured}"))
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    for key in grads_a:
        torch.testing.assert_close(grads_b[key], grads_a[key], atol=1e-5, rtol=1e-5, msg=key)


def _refused(train_workspace, tmp_path, match: str, *overrides) -> None:
    """The run stops with one VatError line matching ``match`` before any step (no metrics written)."""
    out = str(tmp_path / "refused")
    with pytest.raises(VatError, match=match) as err:
        train_main(train_config(train_workspace, out, *overrides))
    assert "\n" not in str(err.value)
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))


def test_bad_captures_stop_in_one_line_before_training(train_workspace, captured, tmp_path):
    other = save_tiny_target(tmp_path / "other", "olmoe", num_experts=8, top_k=2, hidden_size=32)
    _refused(train_workspace, tmp_path, "hidden size 64 .* has 32", f"data.capture={captured}", f"target.path={other}")
    twin = save_tiny_target(tmp_path / "twin", "olmoe", seed=1, num_experts=8, top_k=2)  # the same shapes, other weights
    _refused(train_workspace, tmp_path, "LM head differ", f"data.capture={captured}", f"target.path={twin}")
    bad_vocab = str(tmp_path / "vocab")
    shutil.copytree(captured, bad_vocab)
    manifest = read_manifest(bad_vocab)
    manifest["target"]["vocab_size"] = 512  # a capture from a target with another vocabulary
    write_manifest(bad_vocab, manifest)
    _refused(train_workspace, tmp_path, "vocab size 512", f"data.capture={bad_vocab}")
    only_layer_1 = str(tmp_path / "aux")
    capture(train_workspace["target"], train_workspace["data"], only_layer_1, aux_layer_ids=[1, 1, 1], progress=False)
    _refused(train_workspace, tmp_path, r"capture holds \[1, 1, 1\] \(not \[0, 0\]\)", f"data.capture={only_layer_1}")
    missing = str(tmp_path / "missing")
    shutil.copytree(captured, missing)
    os.remove(os.path.join(missing, read_manifest(missing)["shards"][1]["file"]))
    _refused(train_workspace, tmp_path, "shard_00001.safetensors .* is missing", f"data.capture={missing}")
    few = str(tmp_path / "few")
    capture(train_workspace["target"], train_workspace["data"], few, limit=10, progress=False)
    _refused(train_workspace, tmp_path, "lacks .* rows data.train keeps", f"data.capture={few}")
    _refused(train_workspace, tmp_path, "budget.B is set", f"data.capture={captured}", "budget.B=2")
    unfinished = str(tmp_path / "unfinished")
    shutil.copytree(captured, unfinished)
    manifest = read_manifest(unfinished)
    write_manifest(unfinished, dict(manifest, complete=False, shards=manifest["shards"][:1]))
    _refused(train_workspace, tmp_path, "unfinished", f"data.capture={unfinished}")
    with open(os.path.join(unfinished, MANIFEST), "w") as f:
        json.dump({"format": "other"}, f)
    _refused(train_workspace, tmp_path, "format `other`", f"data.capture={unfinished}")


def test_two_processes_from_a_capture_equal_one_process_on_the_same_global_batches(train_workspace, captured,
                                                                                     tmp_path):
    """Each rank reads the capture rows of its own batches (global batches r, r + 2, ...): 2 gloo processes from a
    capture train as 1 process with grad_accum=2 from it, step for step."""
    two, one = tmp_path / "two", str(tmp_path / "one")
    common = ("method=vat", "loss.union_weight=0.1", "loss.union_scale_warmup=1", "drafter.ttt_steps=3",
              "train.max_steps=3", "train.save_every=0", f"data.capture={captured}")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: vat\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "vat",
           "train", str(recipe), *train_overrides(train_workspace, str(two)), *common]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    train_main(train_config(train_workspace, one, *common, "train.grad_accum=2"))
    a, b = read_metrics(str(two)), read_metrics(one)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3] and b[-1]["union_scale"] > 0
    for ra, rb in zip(a, b):
        for key in ("tokens", "loss", "tau_sim", "acc_0", "vh_bce", "union_sim", "grad_norm", "union_scale"):
            assert ra[key] == pytest.approx(rb[key], rel=2e-5, abs=1e-6), (ra["step"], key)


def _speculators_layout(captured: str, target_dir: str, out: str) -> None:
    """speculators' data-generation layout, written from a vat capture: ``hidden_states/hs_{row}.safetensors`` per
    row with ``token_ids`` and ``hidden_states`` (T, 3 + 1, H), the last one after the final norm (what vLLM hands
    speculators, whose trainer feeds it to the LM head as is)."""
    norm = load_target(target_dir, dtype="float32", device="cpu").final_norm()
    reader = CaptureReader(captured)
    os.makedirs(os.path.join(out, "hidden_states"))
    for row in reader.manifest["rows"]:
        sample = reader.sample(row)
        length, hidden = sample["last"].shape
        with torch.no_grad():
            stacked = torch.cat([sample["aux"].view(length, 3, hidden), norm(sample["last"])[:, None]], dim=1)
        save_file({"token_ids": sample["input_ids"].long(), "hidden_states": stacked.contiguous()},
                  os.path.join(out, "hidden_states", f"hs_{row}.safetensors"))


def test_speculators_hidden_states_train_as_online_without_the_union_term(train_workspace, captured, tmp_path):
    specs = str(tmp_path / "speculators")
    _speculators_layout(captured, train_workspace["target"], specs)
    recipe = ("method=vat", "loss.union_weight=0", "drafter.ttt_steps=3", "train.max_steps=4", "train.save_every=0")
    online, offline = str(tmp_path / "online"), str(tmp_path / "specs")
    train_main(train_config(train_workspace, online, *recipe))
    train_main(train_config(train_workspace, offline, *recipe, f"data.capture={specs}", "target.aux_layer_ids=[1,0,0]"))
    a, b = read_metrics(online), read_metrics(offline)
    assert [r["step"] for r in b] == [1, 2, 3, 4] and "union_sim" in a[0] and "union_sim" not in b[0]
    for ra, rb in zip(a, b):
        for key in ("tokens", "loss", "tau_sim", "acc_0", "acc_2", "vh_bce", "vh_auc", "grad_norm", "vh_grad_norm"):
            _close(ra, rb, key)
    wa = load_file(os.path.join(online, "final", "model.safetensors"))
    wb = load_file(os.path.join(offline, "final", "model.safetensors"))
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=1e-5, rtol=1e-5, msg=key)
    _refused(train_workspace, tmp_path, "holds no routing", f"data.capture={specs}", "target.aux_layer_ids=[1,0,0]",
             "loss.union_weight=0.1")
    _refused(train_workspace, tmp_path, "holds 3 aux layers but does not say which", f"data.capture={specs}")
    _refused(train_workspace, tmp_path, "holds 3 aux layers", f"data.capture={specs}", "target.aux_layer_ids=[1,0]")


def test_dflash_vat_from_a_capture_equals_online(train_workspace, tmp_path):
    """The DFlash block drafter reads its own context layers (1 to L-3: [1, 0] of 2 layers): captured, they train
    as online, with the VAT objective and the union term over its sampled anchors."""
    out = str(tmp_path / "capture")
    capture(train_workspace["target"], train_workspace["data"], out, aux_layer_ids=[1, 0], progress=False)
    recipe = ("method=dflash_vat", "drafter.block_size=4", "drafter.num_layers=2", "drafter.num_anchors=16",
              "drafter.mask_token_id=3", "loss.union_weight=0.1", "loss.union_scale_warmup=1", "train.max_steps=3",
              "train.save_every=0")
    online, offline = str(tmp_path / "online"), str(tmp_path / "offline")
    train_main(train_config(train_workspace, online, *recipe))
    train_main(train_config(train_workspace, offline, *recipe, f"data.capture={out}"))
    a, b = read_metrics(online), read_metrics(offline)
    assert [r["step"] for r in b] == [1, 2, 3] and a[-1]["union_scale"] > 0
    for ra, rb in zip(a, b):
        for key in ("tokens", "loss", "tau_sim", "acc_0", "vh_bce", "union_sim", "union_scale", "grad_norm"):
            _close(ra, rb, key)
    wa = load_file(os.path.join(online, "final", "model.safetensors"))
    wb = load_file(os.path.join(offline, "final", "model.safetensors"))
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=1e-5, rtol=1e-5, msg=key)


def test_a_draft_reading_some_of_the_captured_layers_reads_their_columns(train_workspace, captured, tmp_path):
    """The capture holds layers [1, 0, 0]; a draft reading [0, 1, 1] takes their columns and trains as online."""
    recipe = ("target.aux_layer_ids=[0,1,1]", "train.max_steps=2", "train.save_every=0")
    online, offline = str(tmp_path / "online"), str(tmp_path / "offline")
    train_main(train_config(train_workspace, online, *recipe))
    train_main(train_config(train_workspace, offline, *recipe, f"data.capture={captured}"))
    for ra, rb in zip(read_metrics(online), read_metrics(offline)):
        for key in ("tokens", "loss", "tau_sim", "acc_0", "grad_norm"):
            _close(ra, rb, key)


def test_a_capture_written_in_two_parts_equals_one_run(train_workspace, captured, tmp_path):
    """`--part I/N`: each process writes shards I, I+N, ...; the manifest, rebuilt from the shard files present, is
    complete once both parts ran, and every shard holds the bytes of a one-process capture."""
    out = str(tmp_path / "parts")
    whole = read_manifest(captured)
    first = capture(train_workspace["target"], train_workspace["data"], out, shard_tokens=SHARD_TOKENS, part=(1, 2),
                    progress=False)
    assert not first["complete"]
    assert [s["file"] for s in first["shards"]] == [s["file"] for s in whole["shards"][1::2]]
    with pytest.raises(VatError, match="unfinished"):
        CaptureReader(out)
    assert vat_main(["prep", "capture", "--target", train_workspace["target"], "--data", train_workspace["data"],
                     "--output", out, "--shard-tokens", str(SHARD_TOKENS), "--part", "0/2", "--no-progress"]) == 0
    done = read_manifest(out)
    assert done["complete"] and done["tokens"] == whole["tokens"]
    assert [(s["file"], s["start"], s["end"]) for s in done["shards"]] == [
        (s["file"], s["start"], s["end"]) for s in whole["shards"]]
    for shard in whole["shards"]:
        a, b = load_file(os.path.join(captured, shard["file"])), load_file(os.path.join(out, shard["file"]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert vat_main(["prep", "capture", "--target", train_workspace["target"], "--data", train_workspace["data"],
                     "--output", out, "--part", "2/2"]) != 0  # one line, not a traceback


def test_a_run_from_a_capture_killed_and_resumed_ends_as_an_uninterrupted_one(train_workspace, captured, tmp_path):
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    recipe = (*VAT[:-2], "train.max_steps=4", "train.save_every=2", f"data.capture={captured}")
    train_main(train_config(train_workspace, full, *recipe))
    train_main(train_config(train_workspace, killed, *recipe, "train.stop_after=2"))
    train_main(train_config(train_workspace, killed, *recipe, "resume=auto"))
    a, b = read_metrics(full), read_metrics(killed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("tokens", "loss", "tau_sim", "vh_bce", "union_sim", "union_scale", "grad_norm"):
            assert ra[key] == rb[key], (ra["step"], key)


@pytest.mark.parametrize("family,tied", [(f, False) for f in FAMILIES] + [("qwen3_moe", True)])
def test_the_capture_fed_target_gives_the_targets_logits_in_every_family(family, tied, tmp_path):
    """Only the embedding, final norm and LM head are read from the checkpoint (the tied head from the embedding):
    LM head(final norm(last hidden)) from them is the target's own logits, and the routing shape comes with the
    capture's record."""
    model = tiny_model(family, seed=1)
    if tied:  # an LM head that is the input embedding: the checkpoint holds it once
        config = tiny_config(family)
        config.tie_word_embeddings = True
        model = randomized_routing(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    model.save_pretrained(tmp_path / "target")
    frozen = load_target(str(tmp_path / "target"), dtype="float32", device="cpu", experts_impl="eager")
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    online = frozen.forward(ids)
    captured = load_captured_target(str(tmp_path / "target"), target_identity(frozen, "t"), dtype="float32",
                                    device="cpu")
    out = captured.forward_features(online.aux_hidden, online.last_hidden, online.topk_ids)
    torch.testing.assert_close(out.logits, online.logits, atol=1e-5, rtol=1e-5)
    assert (captured.num_experts, captured.top_k, captured.moe_layer_ids) == (
        frozen.num_experts, frozen.top_k, frozen.moe_layer_ids)
    torch.testing.assert_close(captured.embed_tokens().weight, frozen.embed_tokens().weight)
    if tied:
        torch.testing.assert_close(captured.lm_head().weight, frozen.embed_tokens().weight)


def test_the_recipe_for_a_target_larger_than_one_gpu_trains_from_a_capture():
    """recipes/qwen3_235b_a22b: loads, reads its features from a capture, keeps the union term (vat's captures carry
    routing), and its stated disk per token is the capture layout's bytes at the target's shape."""
    cfg = load_config("recipes/qwen3_235b_a22b/eagle3_vat.yaml")
    assert cfg.data.capture and cfg.target.path == "Qwen/Qwen3-235B-A22B" and cfg.loss.union_weight > 0
    hidden, moe_layers, top_k, experts = 4096, 94, 8, 128  # Qwen3-235B-A22B's config
    routing_bytes = torch.empty((), dtype=routing_dtype(experts)).element_size()  # uint8 for 128 experts
    per_token = (3 * hidden + hidden) * 2 + moe_layers * top_k * routing_bytes + 4  # aux + last (bf16), routing, id
    assert per_token == 33_524
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "qwen3_235b_a22b",
                           "eagle3_vat.yaml")) as f:
        assert "33,524 bytes/token" in f.read()


def test_capture_takes_the_embedded_targets_data_names(train_workspace, captured, tmp_path, monkeypatch):
    """`--data tiny-regen` resolves as a recipe's data.train does (target name, --max-length), so a capture reads the
    rows a run trains on; the build itself is stubbed with the workspace's prepared data (no training in unit tests)."""
    import vat.train.defaults as defaults

    calls = []
    monkeypatch.setattr(defaults, "resolve_train_data",
                        lambda name, target, max_length: calls.append((name, target, max_length))
                        or train_workspace["data"])
    out = str(tmp_path / "by_name")
    assert vat_main(["prep", "capture", "--target", train_workspace["target"], "--data", "tiny-regen",
                     "--max-length", "512", "--output", out, "--shard-tokens", str(SHARD_TOKENS), "--no-progress"]) == 0
    assert calls == [("tiny-regen", train_workspace["target"], 512)]
    manifest, whole = read_manifest(out), read_manifest(captured)
    assert manifest["data"]["path"] == os.path.abspath(train_workspace["data"])
    assert manifest["rows"] == [r for r, n in zip(whole["rows"], whole["lengths"]) if n <= 512]
