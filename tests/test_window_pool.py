"""Window Pool (docs/window_pool.md): pooled routing, gradients, the written target, training, resume and the perplexity grid."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import save_tiny_target
from transformers import AutoTokenizer

from vat.config import load_config
from vat.errors import VatError
from vat.target import BudgetSpec, load_target, window_groups, window_union
from vat.window_pool.pools import draw_constraint
from vat.window_pool.train import WindowPoolTrainer
from vat.window_pool.train import main as wp_main

E, K = 8, 2  # the tiny test target: 8 experts, top-2


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A saved tiny OLMoE target (8 experts, top-2) and a prepared chat dataset built with its tokenizer."""
    from helpers import write_reversed_chats

    from vat.data_prep.chat import prepare_chat

    root = tmp_path_factory.mktemp("window_pool")
    target = save_tiny_target(root / "target", "olmoe", num_experts=E, top_k=K)
    chats = write_reversed_chats(root / "chats.jsonl", 40)
    prepare_chat(str(chats), target, str(root / "data"), max_length=256, progress=False)
    return {"target": target, "data": str(root / "data"), "root": root}


def _cfg(ws, out, *extra):
    return load_config(None, [
        "kind=window_pool", f"target.path={ws['target']}", "target.experts_impl=eager", f"data.train={ws['data']}",
        f"output_dir={out}", "data.tokens_per_batch=1024", "data.max_batch_size=4", "data.max_length=160",
        "train.max_steps=4", "train.save_every=2", "train.lr=1e-2", "train.warmup_ratio=0", "logging.progress=false",
        "window_pool.windows=[3,6]", "window_pool.pools=[2,4]", "window_pool.unconstrained_frac=0.25", *extra,
    ])


def _trainer(ws, out, *extra) -> WindowPoolTrainer:
    trainer = WindowPoolTrainer(_cfg(ws, out, *extra))
    trainer.setup()
    return trainer


def _batch(trainer, n=4):
    from vat.train.data import collate

    return collate([trainer.dataset[i] for i in range(n)], trainer.pad_id)


def _natural_unions(target, ids, window):
    valid = torch.ones_like(ids, dtype=torch.bool)
    out = target.forward(ids, output_aux=False)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    groups, n = window_groups(positions, valid, BudgetSpec(B=None, window=window))
    return out, window_union(out.topk_ids, groups, n, target.num_experts)  # (L', G)


def test_pool_at_least_the_natural_union_is_bit_identical(workspace):
    """d_w = the largest natural window union (< E, so the pooled path runs, not the B >= E early exit)."""
    target = load_target(workspace["target"], experts_impl="eager", device="cpu")
    ids = torch.randint(5, 300, (2, 40))
    natural, unions = _natural_unions(target, ids, window=3)
    d = int(unions.max())
    assert K < d < E
    pooled = target.forward(ids, budget=BudgetSpec(B=d, window=3), output_aux=False)
    assert torch.equal(pooled.logits, natural.logits)
    assert torch.equal(pooled.topk_ids, natural.topk_ids)
    smaller = target.forward(ids, budget=BudgetSpec(B=d - 1, window=3), output_aux=False)
    assert not torch.equal(smaller.logits, natural.logits)  # one expert fewer does change the model


def test_training_forward_with_a_wide_pool_equals_natural_routing(workspace, tmp_path):
    """The trainer's grad-enabled forward: a pool no window fills gives the natural loss bit for bit."""
    trainer = _trainer(workspace, tmp_path / "run", "window_pool.pool_weight=0")
    batch = _batch(trainer)
    natural, _ = trainer.forward_loss(batch, None)
    spec = BudgetSpec(B=E - 1, policy="substitute", window=3)  # a window of 3 tokens x top-2 holds at most 6 < 7
    pooled, sums = trainer.forward_loss(batch, spec)
    assert torch.equal(pooled, natural)
    assert float(sums["inside"]) == float(sums["pool_count"]) > 0  # every natural top-k already inside its pool
    trainer.close()


def test_every_token_routes_inside_its_window_pool(workspace):
    """Executed experts lie in the token's window pool, the pool is the MoE-Spec set of the window (brute force)."""
    target = load_target(workspace["target"], experts_impl="eager", device="cpu")
    ids = torch.randint(5, 300, (2, 37))
    W, d = 5, 3
    spec = BudgetSpec(B=d, window=W, offset=2)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    groups, n_groups = window_groups(positions, torch.ones_like(ids, dtype=torch.bool), spec)
    flat = groups.reshape(-1)
    with target.routing.forward_context(flat, n_groups, spec, capture=True, record_pools=True) as ctx:
        target.model(input_ids=ids, position_ids=positions)
    assert sorted(ctx.pools) == list(range(len(target.moe_layer_ids)))
    for ordinal, (logits, allowed) in ctx.pools.items():
        executed = ctx.captured[ordinal]  # (N, k)
        assert bool(allowed.gather(1, executed).all())  # every token inside its pool
        probs = torch.softmax(logits.float(), dim=-1)
        natural = probs.topk(K, dim=-1).indices
        for g in range(n_groups):
            rows = (flat == g).nonzero().squeeze(-1)
            union = set(natural[rows].reshape(-1).tolist())
            expected = union if len(union) <= d else set(probs[rows].sum(0).topk(d).indices.tolist())
            pool = set(allowed[rows[0]].nonzero().squeeze(-1).tolist())
            assert pool == expected
            assert all(set(allowed[r].nonzero().squeeze(-1).tolist()) == pool for r in rows.tolist())
            assert set(executed[rows].reshape(-1).tolist()) <= pool
    target.close()


def test_only_router_gates_receive_gradients_and_the_pool_carries_them(workspace, tmp_path):
    trainer = _trainer(workspace, tmp_path / "run", "window_pool.pool_weight=0", "window_pool.aux_loss_coef=0")
    batch = _batch(trainer)
    loss, _ = trainer.forward_loss(batch, BudgetSpec(B=2, policy="substitute", window=4))
    loss.backward()
    router = set(trainer.router_names)
    assert router and set(trainer.trainable) == router
    for name, param in trainer.model.named_parameters():
        if name in router:
            assert param.grad is not None and float(param.grad.abs().sum()) > 0, name  # LM loss alone reaches it
        else:
            assert param.grad is None and not param.requires_grad, name
    trainer.close()


def test_lora_adapters_and_routers_train_and_the_merge_keeps_the_logits(workspace, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(workspace, tmp_path / "run", "window_pool.lora.r=4", "train.max_steps=2",
                       "window_pool.lora.target_parameters=[experts.gate_up_proj]")
    batch = _batch(trainer)
    loss, _ = trainer.forward_loss(batch, BudgetSpec(B=2, policy="substitute", window=4))
    loss.backward()
    grads = {n for n, p in trainer.model.named_parameters() if p.grad is not None and float(p.grad.abs().sum()) > 0}
    assert any("lora_B" in n and "q_proj" in n for n in grads)
    assert any("lora_B" in n and "experts" in n for n in grads)
    assert any(n.endswith("gate.weight") for n in grads)
    assert all("lora_" in n or n.endswith("gate.weight") for n in grads)
    trainer.optimizer.zero_grad()
    trainer.run()
    ids = batch["input_ids"][:2]
    with torch.no_grad():
        adapted = trainer.model(input_ids=ids).logits  # peft model after training (adapters non-zero)
    trainer.close()
    final = os.path.join(tmp_path / "run", "final")
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    with torch.no_grad():
        loaded = merged(input_ids=ids).logits
    assert torch.allclose(loaded, adapted, atol=1e-4, rtol=1e-4)
    assert not any("lora" in k for k in merged.state_dict())


@pytest.mark.usefixtures("one_thread")  # bitwise logits: one reduction order (2 threads split sums differently)
def test_written_target_round_trips_and_vat_loads_it(workspace, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    trainer = _trainer(workspace, out)
    trainer.run()
    ids = torch.randint(5, 300, (2, 24))
    with torch.no_grad():
        trained = trainer.model(input_ids=ids).logits
    base = AutoModelForCausalLM.from_pretrained(workspace["target"]).eval()
    trainer.close()
    final = os.path.join(out, "final")
    loaded = AutoModelForCausalLM.from_pretrained(final).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained)
        assert not torch.equal(base(input_ids=ids).logits, trained)  # the routers did move
    changed = [k for k, v in loaded.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed and all(k.endswith("mlp.gate.weight") for k in changed)  # only the router gates
    assert AutoTokenizer.from_pretrained(final).chat_template
    summary = json.load(open(os.path.join(final, "window_pool.json")))
    assert summary["steps"] == 4 and summary["cpu_seconds"] > 0
    target = load_target(final, device="cpu")  # what every vat command does with --target / target.path
    assert target.num_experts == E
    target.close()


def _fitted_target(ws, path, steps=40):
    """The tiny target with every weight fitted to the workspace data (a random model's loss is flat at log V, so
    no routing change could lower it): what continued pretraining starts from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vat.train.data import collate, load_prepared

    ds, _ = load_prepared(ws["data"], 256, 8)
    batch = collate([ds[i] for i in range(8)])
    model = AutoModelForCausalLM.from_pretrained(ws["target"])
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits[:, :-1]
        keep = batch["attention_mask"][:, 1:].bool()
        loss = torch.nn.functional.cross_entropy(logits[keep], batch["input_ids"][:, 1:][keep])
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(ws["target"]).save_pretrained(path)
    return str(path)


def test_short_run_lowers_the_constrained_loss(workspace, tmp_path):
    """Routers alone, one constraint (W 4, d_w 2): the constrained LM loss drops and its gap to natural shrinks."""
    fitted = _fitted_target(workspace, tmp_path / "fitted")
    extra = [f"target.path={fitted}", "window_pool.windows=[4,4]", "window_pool.pools=[2,2]",
             "window_pool.unconstrained_frac=0", "train.max_steps=30", "train.save_every=0", "train.lr=1e-2",
             "window_pool.pool_weight=0", "data.limit=8", "data.max_length=256", "data.tokens_per_batch=4096",
             "data.max_batch_size=8"]
    trainer = _trainer(workspace, tmp_path / "run", *extra)
    batch = _batch(trainer, 8)
    spec = BudgetSpec(B=2, policy="substitute", window=4)

    def nll(constraint):
        with torch.no_grad():
            _, sums = trainer.forward_loss(batch, constraint)
        return float(sums["nll"] / sums["tokens"])

    before, natural_before = nll(spec), nll(None)
    trainer.run()
    after, natural_after = nll(spec), nll(None)
    trainer.close()
    assert before > natural_before + 0.05  # the constraint hurts the fitted target
    # measured 2.970 -> 2.960 (routers only, 30 steps; the gap to natural 0.118 -> 0.098)
    assert after < before - 0.005, (before, after)
    assert after - natural_after < before - natural_before - 0.01


def test_resume_continues_to_the_same_weights(workspace, tmp_path):
    full = tmp_path / "full"
    wp_main(_cfg(workspace, full))
    killed = tmp_path / "killed"
    wp_main(_cfg(workspace, killed, "train.stop_after=2"))
    assert not os.path.exists(killed / "final") and os.path.exists(killed / "checkpoints" / "step_2")
    wp_main(_cfg(workspace, killed, "resume=auto"))
    from safetensors.torch import load_file

    a = load_file(os.path.join(full, "final", "model.safetensors"))
    b = load_file(os.path.join(killed, "final", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la = [json.loads(x)["lm_loss"] for x in open(full / "metrics.jsonl")]
    lb = [json.loads(x)["lm_loss"] for x in open(killed / "metrics.jsonl")]
    assert la == lb


def test_constraint_draws_are_seeded_and_inside_their_ranges(workspace, tmp_path):
    cfg = _cfg(workspace, tmp_path, "window_pool.layers=[1]")
    draws = [draw_constraint(cfg.window_pool, 0, s) for s in range(200)]
    assert draws == [draw_constraint(cfg.window_pool, 0, s) for s in range(200)]
    constrained = [d for d in draws if d is not None]
    assert 0.15 < 1 - len(constrained) / 200 < 0.35
    assert {d.window for d in constrained} == {3, 4, 5, 6} and {d.B[1] for d in constrained} == {2, 3, 4}
    assert all(0 <= d.offset < d.window and list(d.B) == [1] for d in constrained)


def test_the_document_pool_base_routes_each_whole_row_inside_one_pool(workspace, tmp_path):
    """``window_pool.windows: null`` (the document-pool base): every constrained draw is one window per packed row from
    position 0, and under it every token of a row executes inside the same pool, the row's MoE-Spec set (its natural
    union when it fits in d, else the top-d experts by the row's summed router probability), rows apart; two training
    steps run and write the whole-row constraint in their metrics."""
    cfg = _cfg(workspace, tmp_path / "run", "window_pool.windows=null", "window_pool.unconstrained_frac=0.0")
    specs = [draw_constraint(cfg.window_pool, 0, s) for s in range(20)]
    assert all(s.window is None and s.offset == 0 and s.scope == "sequence" and 2 <= s.B <= 4 for s in specs)
    target = load_target(workspace["target"], experts_impl="eager", device="cpu")
    ids = torch.randint(5, 300, (3, 29))
    spec = BudgetSpec(B=3, window=specs[0].window, offset=specs[0].offset, scope=specs[0].scope)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    groups, n_groups = window_groups(positions, torch.ones_like(ids, dtype=torch.bool), spec)
    assert n_groups == 3 and all(set(groups[r].tolist()) == {r} for r in range(3))
    flat = groups.reshape(-1)
    with target.routing.forward_context(flat, n_groups, spec, capture=True, record_pools=True) as ctx:
        target.model(input_ids=ids, position_ids=positions)
    for ordinal, (logits, allowed) in ctx.pools.items():
        probs = torch.softmax(logits.float(), dim=-1)  # (3 * 29, E)
        for r in range(3):
            rows = torch.arange(r * 29, (r + 1) * 29)
            union = set(probs[rows].topk(K, dim=-1).indices.reshape(-1).tolist())
            expected = union if len(union) <= 3 else set(probs[rows].sum(0).topk(3).indices.tolist())
            assert all(set(allowed[i].nonzero().squeeze(-1).tolist()) == expected for i in rows.tolist())
            assert set(ctx.captured[ordinal][rows].reshape(-1).tolist()) <= expected
    target.close()
    wp_main(_cfg(workspace, tmp_path / "run", "window_pool.windows=null", "window_pool.unconstrained_frac=0.0",
                 "train.max_steps=2"))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if '"step"' in line]
    assert [(r["constrained"], r["window"]) for r in records] == [(True, None), (True, None)]


@pytest.mark.parametrize("override, message", [
    ("window_pool.pools=[4,2]", "window_pool.pools"),
    ("window_pool.pools=[2,9]", "cannot exceed"),
    ("window_pool.layers=[7]", "not MoE layers"),
    ("budget.B=4", "unset budget.B"),
    ("window_pool.train_routers=false", "nothing to train"),
])
def test_bad_window_pool_settings_stop_in_one_line(workspace, tmp_path, override, message):
    with pytest.raises(VatError, match=message):
        WindowPoolTrainer(_cfg(workspace, tmp_path, override)).setup()


def test_perplexity_grid_side_by_side(workspace, tmp_path):
    from vat.cli import main as vat_main

    other = save_tiny_target(tmp_path / "other", "olmoe", seed=1, num_experts=E, top_k=K)
    out = tmp_path / "grid"
    rc = vat_main(["profile", "--perplexity-grid", "--target", workspace["target"], "--compare-target",
                   f"wp={other}", "--data", workspace["data"], "--limit", "6", "--windows", "3,40",
                   "--pools", "2,7", "--budgets", "2,4", "--verify-window", "3", "--max-length", "40",
                   "--experts-impl", "eager", "--output", str(out)])
    assert rc == 0
    result = json.load(open(out / "perplexity_grid.json"))
    base = result["results"]["base"]
    assert set(base) == {"natural", "W3_d2", "W3_d7", "W40_d2", "W40_d7", "W3_d4"}
    assert base["natural"]["kl"] == 0 and base["natural"]["agreement"] == 1
    assert base["W3_d7"]["ppl"] == base["natural"]["ppl"]  # 3 tokens x top-2 never need 7 experts
    assert base["W40_d2"]["ppl"] != base["natural"]["ppl"] and base["W40_d2"]["kl"] > 0
    assert base["W3_d2"]["mean_union"] <= 2
    # the natural cell is the plain model's perplexity
    from transformers import AutoModelForCausalLM

    from vat.train.data import collate
    from vat.window_pool.data import heldout_sequences

    rows = heldout_sequences(workspace["data"], workspace["target"], workspace["target"], 40, 6)
    model = AutoModelForCausalLM.from_pretrained(workspace["target"]).eval()
    nll = n = 0.0
    for i in range(len(rows)):
        b = collate([rows[i]])
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"]).logits[0, :-1]
        nll += float(torch.nn.functional.cross_entropy(logits, b["input_ids"][0, 1:], reduction="sum"))
        n += b["input_ids"].shape[1] - 1
    assert abs(base["natural"]["ppl"] - torch.tensor(nll / n).exp().item()) < 1e-3 * base["natural"]["ppl"]
    assert "| 2 | base |" in (out / "perplexity_grid.md").read_text()


def test_recipes_load():
    for recipe in ("recipes/tiny/window_pool.yaml", "recipes/olmoe_1b_7b/window_pool.yaml"):
        cfg = load_config(recipe)
        assert cfg.kind == "window_pool" and cfg.window_pool.pools[0] >= 1


def test_the_bench_builds_pretraining_text_includes_its_code_chats(workspace):
    """`tiny-pretrain` / `tiny-heldout` for the bench target are what its build trained on and held out: the ShareGPT
    conversations and the standard library's functions as code chats (30 % of its text), not ShareGPT alone."""
    from vat.data_prep.tiny_target import pack_conversations, read_conversations, spec_for
    from vat.paths import sharegpt_path
    from vat.window_pool.data import heldout_sequences, training_rows

    spec = spec_for("bench")
    chat_train, chat_heldout, _ = read_conversations(sharegpt_path(), spec)
    tokenizer = AutoTokenizer.from_pretrained(workspace["target"])
    rows = training_rows("tiny-pretrain", "tiny-bench", workspace["target"], None, None)
    chat_rows = pack_conversations(tokenizer, chat_train, spec)
    assert len(rows) > 1.2 * len(chat_rows)  # the code chats add ~30 % of the text
    assert rows.ids[:len(chat_rows) - 1] == chat_rows[:-1].tolist()  # in the build's order: chat first
    heldout = heldout_sequences("tiny-heldout", "tiny-bench", workspace["target"], 64, None)
    assert len(heldout) == len(chat_heldout) + spec.code_heldout


def test_the_seed_summary_judges_each_arm_on_every_constrained_cell():
    """scripts/window_pool_seeds.py on a hand-built grid: per-seed ratios to the base, the t interval over seeds, and
    the goal met only when every constrained cell is below the base and natural perplexity is within +2 %."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "window_pool_seeds.py")
    spec = importlib.util.spec_from_file_location("window_pool_seeds", path)
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)

    def cells(natural, w8):
        return {"natural": {"ppl": natural}, "W8_d4": {"ppl": w8}}

    grid = {"results": {"base": cells(100.0, 200.0),
                        "wp_s0": cells(101.0, 180.0), "wp_s1": cells(101.0, 184.0), "wp_s2": cells(101.0, 182.0),
                        "ctl_s0": cells(100.0, 190.0), "ctl_s1": cells(100.0, 210.0), "ctl_s2": cells(100.0, 200.0),
                        "fat_s0": cells(104.0, 150.0), "fat_s1": cells(104.0, 152.0)}}
    ratios = seeds.seed_ratios(grid)
    assert ratios["wp"]["W8_d4"] == pytest.approx({0: 0.90, 1: 0.92, 2: 0.91})
    assert seeds.verdict(ratios["wp"]).startswith("met: below the base in 1 of 1")
    assert seeds.verdict(ratios["ctl"]).startswith("not met: below the base in 0 of 1")  # 0.95..1.05 spans 1
    assert "unconstrained perplexity +4.0 %" in seeds.verdict(ratios["fat"])
    assert seeds.verdict(ratios["fat"]).startswith("not met")  # better under the constraint, too costly without
    text = seeds.markdown(grid)
    assert "| W8_d4 | 200.00 | 0.910 [" in text and "0.900 / 0.920 / 0.910" in text
    # a second grid of the same text (another call's arms) merges; over the control, paired seed by seed
    doc = {"results": {"base": cells(100.0, 200.0), "doc_s0": cells(110.0, 150.0), "doc_s1": cells(110.0, 160.0)}}
    merged = seeds.merge_grids([grid, doc])
    versus = seeds.seed_ratios(merged, "ctl")
    assert versus["wp"]["W8_d4"] == pytest.approx({0: 180 / 190, 1: 184 / 210, 2: 182 / 200})
    assert versus["doc"]["W8_d4"] == pytest.approx({0: 150 / 190, 1: 160 / 210}) and "ctl" not in versus
    assert "### wp / ctl" in seeds.markdown(merged, "ctl")
    with pytest.raises(SystemExit, match="measured different text"):
        seeds.merge_grids([grid, {"results": {"base": cells(100.0, 201.0)}}])
    # a target measured again in the second grid counts once when its figures agree, and stops the merge when not
    again = {"results": {**doc["results"], "ctl_s0": cells(100.0, 190.0)}}
    assert seeds.merge_grids([grid, again])["results"]["ctl_s0"] == cells(100.0, 190.0)
    with pytest.raises(SystemExit, match="ctl_s0 is in two grids with different"):
        seeds.merge_grids([grid, {"results": {**doc["results"], "ctl_s0": cells(100.0, 191.0)}}])


def test_the_end_to_end_seed_table_averages_arms_and_pairs_them_with_the_control(tmp_path):
    """scripts/window_pool_tables.py --seeds on hand-built eval records: each arm's mean over seeds with its t
    interval, the base's one value, ratios to the control paired seed by seed, and gzip records read like plain."""
    import contextlib
    import gzip
    import importlib.util
    import io
    import sys
    from unittest import mock

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "window_pool_tables.py")
    spec = importlib.util.spec_from_file_location("window_pool_tables", path)
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)

    def record(tau, mib, agreement):
        row = {"tau": tau, "expert_bytes_per_token": mib * 2**20,
               "quality": {"agreement": agreement, "stepwise_agreement": 0.9, "kl_to_natural": 0.01}}
        return {"results": {"none": {"16": {"b@test": {**row, "tau": 1.0}}}, "draft/final": {"16": {"b@test": row}}}}

    base = record(1.50, 10.0, 0.5)
    evals = {"wp_s0": record(1.20, 12.0, 0.2), "wp_s1": record(1.26, 12.0, 0.3), "wp_s2": record(1.32, 12.0, 0.4),
             "ctl_s0": record(1.50, 10.0, 0.3), "ctl_s1": record(1.40, 10.0, 0.3), "ctl_s2": record(1.20, 10.0, 0.3)}
    text = tables.seed_table(base, evals, versus="ctl")
    rows = {line.split(" | ")[2]: line for line in text.splitlines()[2:]}
    assert set(rows) == {"base", "wp", "ctl"}
    assert "| 1 | 1.500 | 10.00 | 50.0% |" in rows["base"]  # the base: one value, no interval, no ratio
    # wp: mean τ 1.26, t interval over three seeds (sd 0.06, t_2 = 4.303): 1.26 ± 0.149
    assert "| 3 | 1.260 [1.111, 1.409] | 12.00 [12.00, 12.00] | 30.0% [5.2%, 54.8%] |" in rows["wp"]
    assert "(0.800 / 0.900 / 1.100)" in rows["wp"] and rows["wp"].endswith("| 1.200 [1.200, 1.200] |")
    assert rows["ctl"].endswith("| – | – |")  # the control is not paired with itself
    # the same records gzipped, through the command line
    for label, ev in {"base": base, **evals}.items():
        with gzip.open(tmp_path / f"{label}.json.gz", "wt") as f:
            json.dump(ev, f)
    args = [str(tmp_path / "base.json.gz")] + [f"{k}={tmp_path / k}.json.gz" for k in evals]
    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["window_pool_tables.py", "--seeds", *args, "--versus", "ctl"]):
        with contextlib.redirect_stdout(out):
            tables.main()
    assert out.getvalue().strip() == text.strip()
    with pytest.raises(SystemExit, match="is not ARM_sSEED"):
        tables.seed_table(base, {"wp": evals["wp_s0"]})
