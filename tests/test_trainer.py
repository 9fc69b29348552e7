"""`vat train` end to end on a tiny saved OLMoE: metrics, checkpoints, exact resume, budgets, VAT switches."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import read_metrics, train_config, train_overrides
from tiny_models import save_tiny_target

from vat.cli import main as vat_main
from vat.errors import VatError
from vat.train.trainer import main as train_main


def test_train_writes_metrics_checkpoints_and_final(train_workspace, tmp_path):
    out = str(tmp_path / "run")
    train_main(train_config(train_workspace, out))
    lines = read_metrics(out)
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "tau_sim", "tokens_per_s", "acc_0", "acc_6", "cond_acc_0", "cond_acc_6", "union_sim"):
        assert key in lines[0], key
    assert all(1.0 <= r["tau_sim"] <= 8.0 for r in lines)
    final = os.path.join(out, "final")
    config = json.load(open(os.path.join(final, "config.json")))
    assert config["target_path"] == train_workspace["target"]
    assert os.path.exists(os.path.join(out, "checkpoints", "step_3", "trainer_state.pt"))
    assert not any(name.startswith(".tmp") for name in os.listdir(os.path.join(out, "checkpoints")))


def test_resume_after_kill_continues_to_the_same_numbers(train_workspace, tmp_path):
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    vat = ("method=vat", "loss.union_weight=0.1", "loss.union_scale_warmup=2", "drafter.ttt_steps=4",
           "train.max_steps=5")
    train_main(train_config(train_workspace, full, *vat))
    train_main(train_config(train_workspace, killed, *vat, "train.stop_after=3"))
    assert [r["step"] for r in read_metrics(killed)] == [1, 2, 3]
    assert not os.path.exists(os.path.join(killed, "final"))
    train_main(train_config(train_workspace, killed, *vat, "resume=auto"))
    a, b = read_metrics(full), read_metrics(killed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b):
        for key in ("loss", "tau_sim", "acc_0", "cond_acc_3", "vh_bce", "vh_auc", "union_sim", "lr", "grad_norm",
                    "union_scale", "union_lambda_eff"):
            assert ra[key] == rb[key], (ra["step"], key)
    # λ's scale: 0 until a step on an informative table was measured (step 1 had no folded routing, step 2's norms
    # count from step 3), then the ratio over steps 2-3, frozen from step 4 (also across the kill after step 3)
    scales = [r["union_scale"] for r in a]
    assert scales[0] == scales[1] == 0.0 and scales[2] > 0 and scales[3] == scales[4] != scales[2]


def test_vat_with_budget_trains_and_logs_vh_and_union(train_workspace, tmp_path):
    out = str(tmp_path / "vat")
    train_main(train_config(train_workspace, out, "method=vat", "budget.B=2", "loss.union_weight=0.1",
                            "train.max_steps=3", "drafter.ttt_steps=3"))
    last = read_metrics(out)[-1]
    for key in ("vh_bce", "vh_auc", "union_sim"):
        assert key in last
    assert 0 < last["union_sim"] <= 8


def test_cli_train_with_recipe_and_overrides(train_workspace, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"method: eagle3\ntarget:\n  path: {train_workspace['target']}\n"
                      f"data:\n  train: {train_workspace['data']}\n"
                      "  tokens_per_batch: 1024\ndrafter:\n  draft_vocab_size: 256\n")
    out = tmp_path / "cli"
    assert vat_main(["train", str(recipe), "train.max_steps=2", f"output_dir={out}", "logging.progress=false"]) == 0
    assert len(read_metrics(str(out))) == 2


def test_resume_with_another_target_fails_clearly(train_workspace, tmp_path):
    out = str(tmp_path / "mismatch")
    train_main(train_config(train_workspace, out, "train.stop_after=3"))
    other = save_tiny_target(tmp_path / "other", "olmoe", num_experts=8, top_k=2, hidden_size=32)
    with pytest.raises(VatError, match="hidden"):
        train_main(train_config(train_workspace, out, f"target.path={other}", "resume=auto"))


def test_two_process_ddp_training_with_gloo(train_workspace, tmp_path):
    """Real multi-process training: 2 CPU processes (torchrun; accelerate picks MULTI_CPU with gloo); metrics are
    global sums. (On GPUs the same entry point runs under `accelerate launch --num_processes N -m vat train`.)"""
    import subprocess
    import sys

    out = tmp_path / "ddp"
    recipe = tmp_path / "ddp.yaml"
    recipe.write_text("method: vat\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "vat", "train", str(recipe),
           *[o for o in train_overrides(train_workspace, str(out)) if not o.startswith("train.max_steps")],
           "train.max_steps=3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = read_metrics(str(out))
    assert [r["step"] for r in lines] == [1, 2, 3]
    # the logged token count is the global sum over both ranks' batches of that step
    from vat.train.data import BucketedBatches, load_prepared

    ds, _ = load_prepared(train_workspace["data"], max_length=160)
    lengths = list(ds["length"])
    per_rank = []
    for rank in (0, 1):
        batches = BucketedBatches(lengths, 512, 4, seed=0, num_replicas=2, rank=rank)
        per_rank.append([b for epoch in range(3) for b in batches.epoch(epoch)])  # the trainer rolls over epochs
    for step, record in enumerate(lines):
        assert record["tokens"] == sum(lengths[i] for rank in (0, 1) for i in per_rank[rank][step])
    assert os.path.exists(out / "final" / "model.safetensors")


def test_a_bad_setting_under_torchrun_ends_on_its_error_line_with_a_clean_exit(train_workspace, tmp_path):
    """Both ranks stop on the same bad setting after the process group is up (a missing training file, found when the
    setup reads the data): the run ends on the one `vat: error:` line with exit code 2; gloo is ended first, so no
    rank aborts at exit."""
    import subprocess
    import sys

    recipe = tmp_path / "bad.yaml"
    recipe.write_text("method: eagle3\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "vat", "train", str(recipe),
           *train_overrides(train_workspace, str(tmp_path / "bad")), f"data.train={tmp_path / 'missing'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode != 0
    # the first rank out prints its line and exits 2; torchrun then stops its peer (which may not get to print)
    assert f"vat: error: prepared dataset not found: {tmp_path / 'missing'}" in done.stderr, done.stderr[:3000]
    assert "failed (exitcode: 2)" in done.stderr, done.stderr[-3000:]
    assert "SIGABRT" not in done.stderr and "terminate called" not in done.stderr, done.stderr[-3000:]


def test_huge_verification_head_gradient_leaves_the_body_update_unchanged(train_workspace, tmp_path):
    """The VH is its own parameter group with its own clip: scaling its loss by 1e6 (detached, so the body's
    gradient is identical) must not change a single body weight, and both gradient norms are logged."""
    from safetensors.torch import load_file

    runs = {}
    for beta in ("1.0", "1e6"):
        out = str(tmp_path / f"beta{beta}")
        train_main(train_config(train_workspace, out, "method=vat", "loss.vh_detach=true", f"loss.vh_weight={beta}",
                                "train.max_steps=3", "train.save_every=0"))
        runs[beta] = (load_file(os.path.join(out, "final", "model.safetensors")), read_metrics(out))
    (w1, m1), (w2, m2) = runs["1.0"], runs["1e6"]
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=0, rtol=0, msg=name)
    for a, b in zip(m1, m2):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        assert b["vh_grad_norm"] > 1e4 * a["vh_grad_norm"] > 0
    # so VAT with a detached head trains the same body as VAT without a head at all (the bench ablation's
    # `vat_detach` and `adaptive_hard` arms: the same drafts, bit for bit)
    out = str(tmp_path / "no_head")
    train_main(train_config(train_workspace, out, "method=vat", "drafter.verification_head=false", "loss.vh_weight=0",
                            "train.max_steps=3", "train.save_every=0"))
    headless = load_file(os.path.join(out, "final", "model.safetensors"))
    assert set(headless) == set(w1)  # the body; the head is written to its own file
    assert os.path.exists(os.path.join(str(tmp_path / "beta1.0"), "final", "verification_head.safetensors"))
    assert not os.path.exists(os.path.join(out, "final", "verification_head.safetensors"))
    for name in headless:
        torch.testing.assert_close(headless[name], w1[name], atol=0, rtol=0, msg=name)


def test_init_from_a_speculators_draft_continues_with_vat_losses(train_workspace, tmp_path):
    """speculators' default recipe flags (norm_before_residual, norm_before_fc, norm_output, sliding window), the full
    vocabulary (no d2t/t2d) and non-default aux layers: imported, exactly the source at step 0, trained with VAT."""
    from transformers import AutoConfig

    from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from vat.export import export_speculators
    from vat.export.target_embedding import read_target_embedding
    from vat.train.trainer import Trainer

    tc = AutoConfig.from_pretrained(train_workspace["target"])
    ids = [0, 1, tc.num_hidden_layers - 1]
    source_cfg = Eagle3Config.for_target(
        tc, draft_vocab_size=tc.vocab_size, aux_layer_ids=ids, norm_before_residual=True, norm_before_fc=True,
        norm_output=True, sliding_window=16, ttt_steps=3,
    )
    torch.manual_seed(3)
    source = Eagle3Drafter(source_cfg, read_target_embedding(train_workspace["target"], tc.vocab_size, tc.hidden_size))
    src = export_speculators(source, str(tmp_path / "spec"))

    out = str(tmp_path / "run")
    trainer = Trainer(train_config(train_workspace, out, f"train.init_from={src}", "method=vat", "train.max_steps=2",
                                   "drafter.ttt_steps=3"))
    trainer.setup()
    try:
        drafter = trainer.accelerator.unwrap_model(trainer.drafter)
        state = drafter.state_dict()
        assert all(torch.equal(state[k].cpu(), v) for k, v in source.state_dict().items())  # step 0 = the source
        assert drafter.verification_head is not None  # VAT's head, fresh
        assert trainer.target.aux_layer_ids == ids and drafter.config.aux_layer_ids == ids
        assert drafter.config.draft_vocab_size == tc.vocab_size  # the source's vocab, not drafter.draft_vocab_size
        last = trainer.run()
    finally:
        trainer.close()
    assert last["step"] == 2 and last["loss"] is not None and 1.0 <= last["tau_sim"] <= 4.0
    saved = json.load(open(os.path.join(out, "final", "config.json")))
    assert (saved["norm_output"], saved["sliding_window"], saved["norm_before_fc"]) == (True, 16, True)
    assert saved["verification_head"] and saved["aux_layer_ids"] == ids


def test_init_from_a_draft_for_another_target_fails_clearly(train_workspace, tmp_path):
    from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from vat.export import save_draft

    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       target_hidden_size=2048, vocab_size=300, draft_vocab_size=300)
    src = save_draft(Eagle3Drafter(cfg), cfg, str(tmp_path / "other"))
    with pytest.raises(VatError, match=r"init_from .*other: draft target_hidden_size 2048 ≠ target hidden_size \d+"):
        train_main(train_config(train_workspace, str(tmp_path / "run"), f"train.init_from={src}"))


def test_init_from_with_a_vocab_file_is_refused_in_one_line(tmp_path):
    """The imported draft brings its vocabulary: a data.vocab beside it would be silently unused."""
    from vat.config import load_config

    with pytest.raises(VatError, match=r"^config keys `train.init_from` and `data.vocab` are both set[^\n]*$"):
        load_config(None, [f"train.init_from={tmp_path}", f"data.vocab={tmp_path / 'v.safetensors'}"])


def test_budgeted_training_forward_prefills_the_prompt_unbudgeted(train_workspace, tmp_path):
    """Prompt-only perturbation: under budget B=1 the trainer's target forward leaves every prompt (non-loss) position
    exactly as the unbudgeted forward computes it — hidden states, logits and routing — while the response positions
    change; budgeting the whole sequence (the old behaviour) changes the prompt positions too."""
    from dataclasses import replace

    from vat.train.data import collate
    from vat.train.trainer import Trainer

    trainer = Trainer(train_config(train_workspace, str(tmp_path / "pf"), "method=vat", "budget.B=1",
                                   "target.experts_impl=eager"))
    trainer.setup()
    try:
        batch = collate([trainer.dataset[i] for i in range(3)], trainer.pad_id)
        budget = replace(trainer.budget, offset=0)
        ids, attn = batch["input_ids"], batch["attention_mask"]
        natural = trainer.target.forward(ids, attention_mask=attn)
        served = trainer._target_forward(batch, budget)
        whole = trainer.target.forward(ids, attention_mask=attn, budget=budget)
    finally:
        trainer.close()
    prompt = attn.bool() & ~batch["loss_mask"].bool()  # (B, T)
    response = attn.bool() & batch["loss_mask"].bool()
    assert prompt.sum() > 10 and response.sum() > 10
    torch.testing.assert_close(served.aux_hidden[prompt], natural.aux_hidden[prompt], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(served.logits[prompt], natural.logits[prompt], atol=1e-6, rtol=1e-6)
    assert torch.equal(served.topk_ids[:, prompt], natural.topk_ids[:, prompt])
    assert (served.window_groups[prompt] == -1).all() and (served.window_groups[response] >= 0).all()
    assert (served.logits[response] - natural.logits[response]).abs().max() > 1e-3  # the budget bites there
    assert (whole.logits[prompt] - natural.logits[prompt]).abs().max() > 1e-3  # and would on the prompt too


def test_compact_strided_affinity_trains_with_the_union_penalty(train_workspace, tmp_path):
    """loss.affinity_storage=uint16 with a layer stride: the union runs over the tracked layers, the saved table is
    (draft vocab, tracked layers, E), and resuming restores the compact state."""
    from safetensors.torch import load_file

    out = str(tmp_path / "compact")
    extra = ("method=vat", "loss.union_weight=0.1", "loss.affinity_storage=uint16", "loss.affinity_layer_stride=2",
             "train.max_steps=3", "drafter.ttt_steps=3")
    train_main(train_config(train_workspace, out, *extra, "train.stop_after=2", "train.save_every=2"))
    last = train_main(train_config(train_workspace, out, *extra, "resume=auto"))
    assert last["step"] == 3 and 0 < last["union_sim"] <= 8 and last["union_loss"] > 0
    table = load_file(os.path.join(out, "final", "affinity.safetensors"))["affinity"]
    assert table.shape == (256, 1, 8)  # 2 MoE layers, stride 2


def test_budgeted_training_folds_natural_routing_into_the_affinity_table(train_workspace, tmp_path):
    """The affinity table learns natural routing under a budget: with only the last MoE layer budgeted (B=1) the
    routers' own top-k of the budgeted forward is the unbudgeted forward's exactly, so the folded table equals the
    one the same batch gives without a budget, while folding the executed (budgeted) ids would not. With every layer
    budgeted the first layer is still exact and later layers are closer to natural than the executed ids."""
    import copy

    from vat.target import BudgetSpec
    from vat.train.data import collate
    from vat.train.trainer import Trainer

    trainer = Trainer(train_config(train_workspace, str(tmp_path / "nat"), "method=vat", "budget.B=[null,1]",
                                   "target.experts_impl=eager"))
    trainer.setup()
    try:
        batch = collate([trainer.dataset[i] for i in range(3)], trainer.pad_id)
        budget = trainer._budget_for_step(0)
        start = copy.deepcopy(trainer.affinity.state_dict())

        def fold(step_budget):
            trainer.affinity.load_state_dict(copy.deepcopy(start))
            trainer.forward_loss(batch, step_budget)
            trainer._fold_affinity()
            return trainer.affinity.table().clone()

        budgeted, natural = fold(budget), fold(None)
        tout = trainer._target_forward(batch, budget)
        plain = trainer.target.forward(batch["input_ids"], attention_mask=batch["attention_mask"])
        # the old behaviour: the executed (budgeted) ids folded into the same starting table
        trainer.affinity.load_state_dict(copy.deepcopy(start))
        rows = trainer.target_to_draft[batch["input_ids"]]
        executed = tout.topk_ids.masked_fill(tout.topk_ids >= trainer.target.num_experts, -1)
        r, i = trainer.affinity.select(rows, executed, batch["attention_mask"].bool())
        trainer.affinity.fold(r, i)
        old = trainer.affinity.table().clone()
        everywhere = trainer.target.forward(batch["input_ids"], attention_mask=batch["attention_mask"],
                                            token_mask=batch["attention_mask"].bool() & batch["loss_mask"].bool(),
                                            budget=BudgetSpec(B=1, window=4))
    finally:
        trainer.close()
    real = batch["attention_mask"].bool()
    assert torch.equal(tout.natural_topk_ids[:, real], plain.topk_ids[:, real])
    assert not torch.equal(tout.topk_ids[1, real], plain.topk_ids[1, real])  # the budget binds on the last layer
    assert torch.equal(budgeted, natural)
    assert (old - natural).abs().max() > 1e-3  # folding budgeted routing would teach another table
    # every layer budgeted: the first router reads an unbudgeted stream; the later one a budgeted stream
    assert torch.equal(everywhere.natural_topk_ids[0][real], plain.topk_ids[0][real])

    def agree(ids):
        return (ids[1][real].sort(-1).values == plain.topk_ids[1][real].sort(-1).values).all(-1).float().mean()

    assert agree(everywhere.natural_topk_ids) > agree(everywhere.topk_ids)
    assert plain.natural_topk_ids is None


def test_budget_align_response_restarts_windows_at_the_response_and_offset_keeps_the_old_tiling(
    train_workspace, tmp_path
):
    """budget.align=response: each row's windows start at its first response position plus that row's phase (seeded
    per step and batch, so a rerun draws the same); budget.align=offset: the step's absolute offset tiling, which
    scope=batch (rows sharing one window set) keeps whatever the alignment."""
    from vat.target.budget import window_groups
    from vat.train.data import collate
    from vat.train.trainer import Trainer

    groups = {}
    for align, scope in (("response", "sequence"), ("offset", "sequence"), ("response", "batch")):
        trainer = Trainer(train_config(train_workspace, str(tmp_path / f"{align}_{scope}"), "method=vat", "budget.B=1",
                                       "drafter.ttt_steps=3", f"budget.align={align}", f"budget.scope={scope}",
                                       "target.experts_impl=eager"))
        trainer.setup()
        try:
            batch = collate([trainer.dataset[i] for i in range(4)], trainer.pad_id)
            budget = trainer._budget_for_step(0)
            got = groups[align, scope] = trainer._target_forward(batch, budget).window_groups
            again = trainer._target_forward(batch, budget).window_groups
            phases = trainer._window_phases(4)
        finally:
            trainer.close()
        assert torch.equal(got, again)
        response = batch["attention_mask"].bool() & batch["loss_mask"].bool()
        positions = torch.arange(response.shape[1]).expand_as(response)
        if align == "offset" or scope == "batch":  # rows sharing one window set keep the absolute tiling
            expected, _ = window_groups(positions, response, budget)
        else:
            from dataclasses import replace

            expected, _ = window_groups(positions, response, replace(budget, phase=phases))
            for b in range(4):
                start = int(response[b].float().argmax())
                first = got[b, start]
                # the leading window is [start, start + phase) (the whole first window when the phase is 0)
                assert int((got[b] == first).sum()) == (phases[b] or 4)
        assert torch.equal(got, expected)
    response, offset = groups["response", "sequence"], groups["offset", "sequence"]
    assert torch.equal(response >= 0, offset >= 0)  # the same budgeted cells, other windows
    assert not torch.equal(response, offset)


def test_at_lambda_zero_the_union_runs_only_on_logging_steps_and_changes_no_number(train_workspace, tmp_path,
                                                                                    monkeypatch):
    """λ = 0: the union term (expected expert use over the draft vocab, soft union) runs on the steps that log
    union_sim only; every other number, and the trained weights, are those of a run that computes it every step."""
    from safetensors.torch import load_file

    import vat.train.trainer as trainer_module

    real, calls = trainer_module.vat_objective, []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("affinity") is not None)
        return real(*args, **kwargs)

    every, sparse = str(tmp_path / "every"), str(tmp_path / "sparse")
    base = ("method=vat", "drafter.ttt_steps=3", "train.max_steps=4")
    train_main(train_config(train_workspace, every, *base, "train.log_every=1"))
    monkeypatch.setattr(trainer_module, "vat_objective", counting)  # the name the trainer calls
    train_main(train_config(train_workspace, sparse, *base, "train.log_every=2"))
    per_step = len(calls) // 4
    assert per_step >= 1 and len(calls) == 4 * per_step
    assert calls == [False] * per_step + [True] * per_step + [False] * per_step + [True] * per_step
    a, b = read_metrics(every), read_metrics(sparse)
    assert [r["step"] for r in b] == [2, 4]
    assert all(0 < r["union_sim"] <= 8 for r in b)
    for key in ("lr", "grad_norm"):
        assert b[-1][key] == a[-1][key], key
    wa, wb = load_file(os.path.join(every, "final", "model.safetensors")), load_file(os.path.join(sparse, "final",
                                                                                                   "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
