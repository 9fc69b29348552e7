"""DFlash training: the slot layout the losses consume (brute force), the DFlash loss against SpecForge's formula
written out by hand, and short real runs on the quick tiny target (DFlash, DFlash + VAT under a budget, exact resume)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from vat.config import load_config
from vat.drafters.dflash import DFlashBlockOutput, DFlashDrafter
from vat.losses import LossSwitches, routing_onehot, vat_objective
from vat.slots import block_slots
from vat.verify import simulate_verification, target_dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "recipes", "tiny")


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(seed: int = 0, B: int = 2, T: int = 24, V: int = 11, K: int = 3, L: int = 2, E: int = 6):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g) * 2
    argmax = logits.argmax(-1)
    follow = torch.rand(B, T, generator=g) < 0.7  # mostly on-policy data: the next token is the target's argmax
    input_ids[:, 1:] = torch.where(follow[:, 1:], argmax[:, :-1], input_ids[:, 1:])
    loss_mask = (torch.rand(B, T, generator=g) < 0.8).long()
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, T - 5 :] = 0
    loss_mask[1, T - 5 :] = 0
    topk = torch.randint(0, E, (L, B, T, 2), generator=g)
    anchors = torch.tensor([[1, 5, 6, 20, 22], [3, 17, 18, -1, -1]])
    batch = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
    draft_logits = torch.randn(B, anchors.shape[1], K, V, generator=g)
    return batch, logits, topk, anchors, draft_logits


def test_block_slots_gather_targets_labels_routing_and_censoring_like_a_loop():
    batch, logits, topk, anchors, draft_logits = _batch()
    B, N, K, V = draft_logits.shape
    T = logits.shape[1]
    out = DFlashBlockOutput(logits=draft_logits, hidden=torch.zeros(B, N, K, 1), vh_logits=None)
    slots = block_slots(out, target_dist(logits), batch, topk, 6, anchors, onpolicy=True)
    ids, lm, am = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    argmax = logits.argmax(-1)
    onehot = routing_onehot(topk, 6)
    for b in range(B):
        for n in range(N):
            a = int(anchors[b, n])
            if a >= 0:
                assert torch.equal(slots.anchor_routing[b, n], onehot[b, a])
            off_policy = False
            for k in range(K):
                tok = a + 1 + k  # the token slot k predicts; the target's distribution for it sits at a + k
                valid = a >= 0 and tok < T and bool(lm[b, tok]) and bool(am[b, tok])
                assert bool(slots.valid[b, n, k]) == valid, (b, n, k)
                if valid:
                    assert int(slots.target.argmax[b, n, k]) == int(argmax[b, a + k])
                    torch.testing.assert_close(slots.target.probs[b, n, k], logits[b, a + k].softmax(-1))
                    assert int(slots.imitation.argmax_draft[b, n, k]) == int(ids[b, tok])  # DFlash's label: data
                    # observed while every data token the target read after the anchor was its own argmax
                    assert bool(slots.censored[b, n, k]) == off_policy, (b, n, k)
                if a >= 0 and tok < T:
                    off_policy = off_policy or int(ids[b, tok]) != int(argmax[b, a + k])


def test_dflash_preset_loss_is_the_weighted_mean_of_hard_ce_on_the_data_token():
    """SpecForge's DFlash loss, written out: Σ_valid w_k CE(q_k, x_{a+k}) / Σ_valid w_k, w_k = exp(-(k-1)/γ)."""
    batch, logits, topk, anchors, draft_logits = _batch(seed=3, K=7)
    cfg = load_config(None, ["method=dflash", "drafter.block_size=8"])
    sw = LossSwitches.from_config(cfg.loss, kind=cfg.drafter.kind, block_size=cfg.drafter.block_size)
    assert (sw.soft_weight, sw.hard_weight, sw.adaptive_weights, sw.imitation_norm) == (0.0, 1.0, False, "weight_sum")
    B, N, K, V = draft_logits.shape
    out = DFlashBlockOutput(logits=draft_logits.requires_grad_(True), hidden=torch.zeros(B, N, K, 1), vh_logits=None)
    slots = block_slots(out, target_dist(logits), batch, topk, 6, anchors, onpolicy=False)
    loss, _ = vat_objective(slots.logits, slots.imitation, slots.valid, sw,
                            verification=simulate_verification(slots.logits, slots.target, slots.valid))
    gamma = 3.5  # 7 * 8 / 16
    num = den = 0.0
    for b in range(B):
        for n in range(N):
            a = int(anchors[b, n])
            for k in range(K):
                j = k + 1  # DFlash's 1-indexed block position
                tok = a + j
                if a < 0 or tok >= logits.shape[1] or not batch["loss_mask"][b, tok] or not batch["attention_mask"][b, tok]:
                    continue
                w = math.exp(-(j - 1) / gamma)
                ce = F.cross_entropy(draft_logits[b, n, k][None].detach().double(), batch["input_ids"][b, tok].view(1))
                num += w * float(ce)
                den += w
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    loss.backward()
    assert draft_logits.grad.abs().sum() > 0


# ---- real runs on the quick tiny target --------------------------------------------------------------------------


def _train(out, *extra):
    from vat.train.trainer import main as train_main

    cfg = load_config(os.path.join(RECIPES, extra[0]), [
        "target.path=tiny-quick", f"output_dir={out}", "data.tokens_per_batch=512", "data.max_batch_size=4",
        "drafter.num_anchors=24", "train.save_every=2", "logging.progress=false", *extra[1:],
    ])
    train_main(cfg)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_dflash_vat_trains_under_a_budget_and_resumes_to_the_same_numbers(tmp_path):
    """DFlash + VAT (VH per slot, adaptive weights, union penalty) against the budgeted target; a run killed after
    step 2 and resumed ends where an uninterrupted one does (anchors drawn from the data position, not global RNG)."""
    from vat.export import load_draft

    args = ("dflash_vat.yaml", "train.max_steps=3", "budget.B=8", "loss.union_weight=0.1")
    full = _train(str(tmp_path / "full"), *args)
    assert [r["step"] for r in full] == [1, 2, 3]
    for r in full:
        assert 1.0 <= r["tau_sim"] <= 8.0 and 0 < r["union_sim"] <= 16
        for key in ("acc_0", "acc_6", "cond_acc_6", "vh_bce", "loss_6", "censored"):
            assert key in r, key
        assert "acc_7" not in r  # block 8: seven drafted slots
    _train(str(tmp_path / "killed"), *args, "train.stop_after=2")
    resumed = _train(str(tmp_path / "killed"), *args, "resume=auto")
    for a, b in zip(full, resumed):
        for key in ("loss", "tau_sim", "acc_0", "vh_bce", "union_sim", "grad_norm"):
            assert a[key] == b[key], (a["step"], key)
    model, cfg = load_draft(str(tmp_path / "full" / "final"))
    assert isinstance(model, DFlashDrafter) and model.verification_head is not None
    assert (cfg.block_size, cfg.num_hidden_layers, cfg.target_layer_ids, cfg.mask_token_id) == (8, 2, [1, 5], 4)


def test_anchors_are_sampled_from_the_host_copies_of_the_masks(tmp_path, monkeypatch):
    """DFlash's anchor sampling reads the batch's CPU masks (``host_*``: no device-to-host copy on a GPU), not the
    device ones: with the host loss mask cut to each row's first half, every anchor lies in that half."""
    import vat.train.kinds.dflash as dflash_kind
    from vat.train.loop import TrainLoop

    plain_next = TrainLoop.next_batch
    halves, drawn = [], []

    def next_batch(self):
        indices, batch = plain_next(self)
        host = batch["host_loss_mask"].clone()
        host[:, host.shape[1] // 2:] = 0
        halves.append(host.shape[1] // 2)
        batch["host_loss_mask"] = host
        return indices, batch

    def sample(*args, **kwargs):
        anchors = plain_sample(*args, **kwargs)
        drawn.append(anchors)
        return anchors

    plain_sample = dflash_kind.sample_block_anchors
    monkeypatch.setattr(TrainLoop, "next_batch", next_batch)
    monkeypatch.setattr(dflash_kind, "sample_block_anchors", sample)
    _train(str(tmp_path / "dflash"), "dflash.yaml", "train.max_steps=2", "train.save_every=0")
    assert drawn and len(drawn) == len(halves)
    for anchors, half in zip(drawn, halves):
        real = anchors[anchors >= 0]
        assert real.numel() > 0 and int(real.max()) < half


def test_dflash_baseline_loss_falls(tmp_path):
    lines = _train(str(tmp_path / "dflash"), "dflash.yaml", "train.max_steps=6", "train.save_every=0")
    assert lines[-1]["loss"] < lines[0]["loss"] and "vh_bce" not in lines[-1]


@pytest.mark.parametrize("recipe", ["tiny/dflash.yaml", "tiny/dflash_vat.yaml", "qwen3_30b_a3b/dflash_vat.yaml"])
def test_dflash_recipes_load_with_their_method_presets(recipe):
    cfg = load_config(os.path.join(REPO, "recipes", recipe))
    assert cfg.drafter.kind == "dflash" and cfg.method in ("dflash", "dflash_vat")
    sw = LossSwitches.from_config(cfg.loss, kind=cfg.drafter.kind, block_size=cfg.drafter.block_size)
    assert sw.dflash_gamma == pytest.approx(7.0 * cfg.drafter.block_size / 16)
    vat = cfg.method == "dflash_vat"
    assert (sw.adaptive_weights, sw.vh_weight > 0, cfg.drafter.verification_head) == (vat, vat, vat)
    assert sw.imitation_norm == ("anchors" if vat else "weight_sum") and sw.soft_weight == (1.0 if vat else 0.0)
    with open(os.path.join(REPO, "recipes", recipe)) as f:
        assert "vat train recipes/" + recipe in f.read()  # the launch command in the header


def test_the_lm_head_inside_the_loss_trains_as_the_materialised_logits(tmp_path, monkeypatch):
    """DFlash + VAT with the full-vocabulary readout inside the chunked loss (``loss.imitation_chunk_mb`` set: the
    drafter hands the loss HeadLogits) against the autograd reference on materialised logits (null): the same loss,
    τ_sim, accuracies and gradient norm at every step."""
    from vat.imitation import HeadLogits

    seen = []
    plain = DFlashDrafter.forward

    def forward(self, *args, **kwargs):
        out = plain(self, *args, **kwargs)
        seen.append(isinstance(out.logits, HeadLogits))
        return out

    monkeypatch.setattr(DFlashDrafter, "forward", forward)
    args = ("dflash_vat.yaml", "train.max_steps=2", "train.save_every=0", "loss.union_weight=0.1")
    lazy = _train(str(tmp_path / "lazy"), *args, "loss.imitation_chunk_mb=0.05")
    assert seen and all(seen)
    seen.clear()
    reference = _train(str(tmp_path / "reference"), *args, "loss.imitation_chunk_mb=null")
    assert seen and not any(seen)
    for a, b in zip(lazy, reference, strict=True):
        for key in ("loss", "tau_sim", "acc_0", "vh_bce", "union_sim", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
