"""Multi-process training is the same training at any world size (docs/architecture.md), with real gloo processes on CPU.

vat's objective is a mean over each micro-batch's anchors, and one optimizer step averages its micro-batches: DDP
averages the ranks' gradients, accumulation divides each micro-batch's loss by ``grad_accum``. So the global batch of a
2-process step (rank 0's and rank 1's batch: BucketedBatches gives rank r the epoch's batches r, r+2, ...) is exactly
one process with ``grad_accum=2`` over the same two batches in rank order — NOT one process with the two batches
concatenated (that would weight each anchor by 1/(all anchors) instead of 1/(its micro-batch's anchors)). The tests
compare against that run: loss, metrics, the gradient the optimizer steps, the LR schedule, the online affinity table,
and resumption of a 2-process checkpoint with 1 and with 2 processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import read_metrics, train_overrides

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_probe.py")
# a schedule that moves every step (warmup 2, cosine 2), the union term in the gradient on a sample of 8 anchors per
# micro-batch (seeded by the global batch index, so both world sizes draw the same), checkpoints at step 2
COMMON = ("method=vat", "loss.union_weight=0.1", "loss.union_max_anchors=8", "drafter.ttt_steps=3",
          "train.max_steps=4", "train.save_every=2", "train.warmup_ratio=0.5", "train.keep_last=0")
COMPARED = ("loss", "tau_sim", "acc_0", "cond_acc_2", "vh_bce", "vh_auc", "union_sim", "grad_norm", "vh_grad_norm",
            "tokens", "union_scale")


def _torchrun(nproc: int, grads: str, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), PROBE,
           grads, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(train_workspace, tmp_path_factory):
    """Four runs of the same 4 steps: 2 processes killed after step 2 then resumed with 2 (``two``), 1 process with
    grad_accum=2 uninterrupted (``one``), and the 2-process checkpoint resumed with 1 process (``two_then_one``)."""
    from dist_probe import run

    root = tmp_path_factory.mktemp("dist")
    paths = {name: str(root / name) for name in ("two", "one", "two_then_one")}

    def ovr(name, *extra):
        return [*train_overrides(train_workspace, paths[name]), *COMMON, *extra]

    _torchrun(2, str(root / "g_two"), ovr("two", "train.stop_after=2"))
    shutil.copytree(paths["two"], paths["two_then_one"])
    _torchrun(2, str(root / "g_two"), ovr("two", "resume=auto"))
    # one intra-op thread, as each torchrun process has: a different thread count changes fp32 reduction order, and
    # the union term's gradient-ratio scale (~1e7 on a fresh draft, whose union gradient is near zero) magnifies
    # that into a 2 % loss difference at step 1 (seen in CI, where pytest runs with 2 threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(str(root / "g_one"), ovr("one", "train.grad_accum=2"))
        run(str(root / "g_two_then_one"), ovr("two_then_one", "train.grad_accum=2", "resume=auto"))
    finally:
        torch.set_num_threads(threads)
    return {"root": root, **paths}


def _same(a: dict, b: dict, key: str) -> None:
    """One logged metric equal within fp32 tolerance (an undefined ratio is null in both)."""
    if b[key] is None:
        assert a[key] is None, (a["step"], key)
    else:
        assert a[key] == pytest.approx(b[key], rel=2e-5, abs=1e-6), (a["step"], key)


def _grads(runs, name, step):
    return torch.load(os.path.join(runs["root"], f"g_{name}", f"step{step}.pt"))


def _final(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "final", "model.safetensors"))


def _affinity(path, where):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, where, "affinity.safetensors"))["affinity"]


def test_two_process_lr_schedule_equals_one_process(runs):
    """accelerate's prepared scheduler stepped num_processes times per optimizer step: warmup and cosine ended
    halfway with 2 processes. Stepped once per optimizer step, the schedule is the world-size-free one."""
    two, one = read_metrics(runs["two"]), read_metrics(runs["one"])
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4]
    assert [r["lr"] for r in two] == pytest.approx([r["lr"] for r in one], rel=1e-12)
    lr = [r["lr"] for r in one]
    assert lr[0] == pytest.approx(0.5e-3) and lr[1] == pytest.approx(1e-3) and lr[3] < lr[2] < lr[1]


def test_two_process_loss_and_gradient_equal_one_process_on_the_same_global_batch(runs):
    two, one = read_metrics(runs["two"]), read_metrics(runs["one"])
    for a, b in zip(two, one):
        for key in COMPARED:
            _same(a, b, key)
    # the union's scale is summed over both ranks' micro-batches: it pulls from step 3 (step 2 measured) on both
    assert one[1]["union_scale"] == 0.0 and one[2]["union_scale"] > 0 and one[3]["union_scale"] > 0
    for step in (1, 2, 3, 4):  # the gradient the optimizer steps (after DDP's all-reduce / after accumulation)
        g2, g1 = _grads(runs, "two", step), _grads(runs, "one", step)
        assert set(g2) == set(g1) and len(g1) > 5
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
    for name, value in _final(runs["one"]).items():
        torch.testing.assert_close(_final(runs["two"])[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_two_process_checkpoint_resumes_in_one_and_in_two_processes(runs):
    """Saved with 2 processes after step 2: resumed with 2 (above) and with 1 (grad_accum=2, the same global batch),
    both continue to the uninterrupted run's numbers: data position, optimizer, scheduler, affinity and RNG."""
    state = torch.load(os.path.join(runs["two_then_one"], "checkpoints", "step_2", "trainer_state.pt"),
                       weights_only=False)
    assert state["world_size"] == 2 and len(state["rng"]) == 2
    one, resumed = read_metrics(runs["one"]), read_metrics(runs["two_then_one"])
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed[2:], one[2:]):
        for key in (*COMPARED, "lr", "epoch"):
            _same(a, b, key)
    for step in (3, 4):
        g, ref = _grads(runs, "two_then_one", step), _grads(runs, "one", step)
        for name in ref:
            torch.testing.assert_close(g[name], ref[name], rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
    for name, value in _final(runs["one"]).items():
        torch.testing.assert_close(_final(runs["two_then_one"])[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_reduced_affinity_table_equals_one_process_on_the_same_batches(runs):
    """Every rank folds the whole global batch's routing once per step: the saved table (rank 0's) is the table one
    process builds from the same batches — bit for bit, since only integer counts are added."""
    for where in ("checkpoints/step_2", "final"):
        one = _affinity(runs["one"], where)
        assert torch.equal(_affinity(runs["two"], where), one), where
        assert torch.equal(_affinity(runs["two_then_one"], where), one), where


def _fold_worker(rank: int, world: int, init: str, batches: list, out: str) -> None:
    import torch.distributed as dist

    from vat.affinity import OnlineAffinity
    from vat.train.distributed import end_process_group, gather_rows

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        aff = OnlineAffinity(11, 3, 8, 2, ema=0.9)
        for step in batches:
            rows, ids = aff.select(*step[rank])
            aff.fold(gather_rows(rows), gather_rows(ids))
        torch.save(aff.state_dict(), f"{out}.{rank}")
        end_process_group()  # no rank tears gloo down while its peer still works (an early exit can abort the other)
    finally:
        end_process_group(wait=False)  # after a failure (a no-op once ended)


def test_gathered_affinity_fold_equals_one_process_fold_with_real_gloo(tmp_path):
    """Unit level: 2 gloo processes, each with its own batches of different lengths, fold gathered routing; both
    ranks end with the table one process folds from the concatenated batches."""
    import torch.multiprocessing as mp

    from vat.affinity import OnlineAffinity

    gen = torch.Generator().manual_seed(0)

    def batch(T):
        rows = torch.randint(-1, 11, (2, T), generator=gen)
        ids = torch.randint(-1, 8, (3, 2, T, 2), generator=gen)
        return rows, ids, torch.rand(2, T, generator=gen) > 0.2

    steps = [[batch(5), batch(9)], [batch(7), batch(3)], [batch(4), batch(4)]]
    mp.spawn(_fold_worker, args=(2, f"file://{tmp_path}/rdv", steps, str(tmp_path / "aff")), nprocs=2, join=True)
    one = OnlineAffinity(11, 3, 8, 2, ema=0.9)
    for step in steps:
        parts = [one.select(*b) for b in step]
        one.fold(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    for rank in (0, 1):
        state = torch.load(tmp_path / f"aff.{rank}")
        for key, value in one.state_dict().items():
            assert torch.equal(state[key], value), (rank, key)
    assert float(one.token_counts.sum()) > 0


def _ending_worker(rank: int, world: int, init: str, out: str) -> None:
    import time

    import torch.distributed as dist

    from vat.train.distributed import end_process_group

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if rank == 0:
        time.sleep(1.5)  # rank 0 still works (as it does while it writes the final draft)
    began = time.time()
    end_process_group()
    torch.save({"began": began, "ended": time.time(), "still_up": dist.is_initialized()}, f"{out}.{rank}")


def test_end_process_group_holds_every_rank_until_the_last_is_done_then_tears_down(tmp_path):
    """The CLI's teardown after a command: a rank that finishes first waits for its peer, then the group is gone on
    both (a rank exiting with gloo up while its peer works can abort at interpreter exit)."""
    import torch.multiprocessing as mp

    mp.spawn(_ending_worker, args=(2, f"file://{tmp_path}/rdv", str(tmp_path / "end")), nprocs=2, join=True)
    busy, early = (torch.load(f"{tmp_path / 'end'}.{rank}") for rank in (0, 1))
    assert not busy["still_up"] and not early["still_up"]
    assert early["ended"] >= busy["began"]  # rank 1 came back only once rank 0 had started tearing down
    assert early["ended"] - early["began"] >= 1.0


def test_resume_position_counts_global_batches():
    from vat.train.distributed import world_size_position

    assert world_size_position(3, 2, 1) == (6, 0)  # 2 -> 1 process: 6 global batches done
    assert world_size_position(6, 1, 2) == (3, 0)
    assert world_size_position(3, 2, 4) == (2, 2)  # 6 done, 4 processes: round up, skip 2, never repeat


@pytest.mark.gpu
def test_fsdp2_training_through_accelerate_on_gpu(train_workspace, tmp_path):
    """`train.fsdp=true`: FSDP2 through accelerate's plugin. Accelerate shards only on accelerators (CPU processes
    run MULTI_CPU/DDP), so this runs where there is a GPU; on CPU the key is refused in one line."""
    out = str(tmp_path / "fsdp")
    overrides = [*train_overrides(train_workspace, out), *COMMON, "train.fsdp=true", "train.mixed_precision=no"]
    _torchrun(min(torch.cuda.device_count(), 2), str(tmp_path / "g"), overrides)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    state = torch.load(os.path.join(out, "checkpoints", "step_2", "trainer_state.pt"), weights_only=False)
    assert state["sharded"] == (torch.cuda.device_count() >= 2) and "fc.weight" in state["drafter"]  # full tensors
    assert json.load(open(os.path.join(out, "final", "config.json")))["vat_format"] == "eagle3"


def test_fsdp_is_refused_on_cpu_in_one_line(train_workspace, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("GPU machine: FSDP2 is available")
    from vat.config import load_config
    from vat.errors import VatError
    from vat.train.trainer import main as train_main

    with pytest.raises(VatError, match=r"^train.fsdp needs GPUs"):
        train_main(load_config(None, [*train_overrides(train_workspace, str(tmp_path / "x")), "train.fsdp=true"]))


def _fsdp_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vat.config import LoraTrainConfig
    from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from vat.train.distributed import end_process_group, full_state_dicts, load_full_state_dicts
    from vat.train.lora import apply_lora, merged_draft

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           target_hidden_size=32, vocab_size=50, draft_vocab_size=50, verification_head=True)

        def build(seed):
            torch.manual_seed(seed)
            model = Eagle3Drafter(cfg)
            apply_lora(model, OmegaConf.structured(LoraTrainConfig(r=4, alpha=8.0)))
            with torch.no_grad():  # adapters away from their zero start, so the merge is not the base
                for name, p in model.named_parameters():
                    if ".lora_B." in name:
                        p.normal_()
            return model

        model = build(1)
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.ones_like(p)
        optim.step()
        model_state, optim_state = full_state_dicts(model, optim, sharded=True)
        # a differently seeded sharded twin loads the full state and gives it back unchanged
        twin = build(2)
        fully_shard(twin, mesh=init_device_mesh("cpu", (world,)))
        twin_optim = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
        objects = [model_state, optim_state]
        dist.broadcast_object_list(objects, src=0)  # every rank passes the full dicts, as read from a checkpoint
        load_full_state_dicts(twin, twin_optim, objects[0], objects[1], sharded=True)
        again, again_optim = full_state_dicts(twin, twin_optim, sharded=True)
        if rank == 0:
            plain = merged_draft(model, model_state)
            merged = plain.state_dict()
            torch.save({"reference": reference, "state": model_state, "optim": optim_state, "again": again,
                        "again_optim": again_optim, "merged": merged, "type": type(plain).__name__}, out)
        end_process_group()  # rank 1 waits for rank 0's merge and save before either tears gloo down
    finally:
        end_process_group(wait=False)  # after a failure (a no-op once ended)


def test_fsdp2_full_state_dicts_gather_resume_and_merge_with_real_gloo(tmp_path):
    """The FSDP2 checkpoint helpers on a LoRA draft sharded with torch's fully_shard over 2 gloo processes (what
    accelerate's FSDP2 plugin applies on GPUs): rank 0 gets full tensors under the unsharded names, a sharded twin
    loads them back exactly (model and optimizer), and the merged draft is built from the gathered state."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "fsdp.pt")
    mp.spawn(_fsdp_worker, args=(2, f"file://{tmp_path}/rdv", out), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    assert got["type"] == "Eagle3Drafter"
    reference, state = got["reference"], got["state"]
    assert set(state) == set(reference) and not any(hasattr(v, "full_tensor") for v in state.values())
    for name, value in reference.items():  # the optimizer stepped only the trainable weights
        trains = ".lora_" in name or name.startswith("verification_head.")
        assert torch.equal(state[name], value) != trains, name
        assert torch.equal(got["again"][name], state[name]), name
    for pid, entry in got["optim"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["again_optim"]["state"][pid][key], value), (pid, key)
    merged = got["merged"]
    assert not any(".lora_" in k or ".base_layer." in k for k in merged)
    a, b = state["midlayer.self_attn.q_proj.lora_A.default.weight"], state["midlayer.self_attn.q_proj.lora_B.default.weight"]
    torch.testing.assert_close(merged["midlayer.self_attn.q_proj.weight"],
                               state["midlayer.self_attn.q_proj.base_layer.weight"] + 2.0 * b @ a)


def test_a_nan_on_one_rank_is_skipped_by_both_without_a_hang(train_workspace, tmp_path):
    """Rank 1 alone sees a NaN loss at step 2: both ranks agree to skip it (an all-reduced flag), so neither waits in a
    gradient all-reduce the other never joins; the run ends (a hang would hit the timeout) with step 2 unlogged."""
    out = str(tmp_path / "nan")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", PROBE,
           str(tmp_path / "g"), *train_overrides(train_workspace, out), *COMMON]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
               VAT_PROBE_NAN="1,2")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 3, 4] and records[-1]["nonfinite_skipped"] == 1


def test_two_process_dflash_training_runs_through_the_wrapped_drafter(train_workspace, tmp_path):
    """DFlash under 2 processes: the drafter the step calls is accelerate's DDP wrapper, so the kind must read its
    settings (the block size its anchors are drawn for) from the draft's config, not from the module it calls."""
    out = str(tmp_path / "dflash")
    _torchrun(2, str(tmp_path / "g"), [*train_overrides(train_workspace, out), "method=dflash_vat",
                                       "drafter.block_size=4", "drafter.num_layers=1", "drafter.mask_token_id=3",
                                       "train.max_steps=2", "train.save_every=0"])
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2] and "acc_2" in records[-1] and "acc_3" not in records[-1]
