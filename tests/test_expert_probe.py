"""EcoSpec's context-aware expert predictor (`vat prep expert-probe`, vat/eval/expert_probe.py): the captured pairs
against the target's routing and the draft's unroll read by hand, the probe learning a context the table cannot see,
the file round trip into EcoSpec's predictor, and the command end to end with a lossless EcoSpec decode."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import olmoe_with_eagle3_drafts, write_reversed_chats

from vat.eval.ecospec import ExpertPredictor
from vat.eval.expert_probe import capture_pairs, fit_probe, predictor_quality, topk_recall

pytestmark = pytest.mark.usefixtures("one_thread")


def test_captured_pairs_are_the_draft_state_and_the_routing_of_the_guessed_position():
    """Pair (t, k): the draft's unroll state h(t, k) and the experts the target executed at t + 2 + k, the position
    where step k's guess is read; the prior is the table's row of the token there."""
    model, target, drafts, prompts = olmoe_with_eagle3_drafts(torch.Generator().manual_seed(3))
    try:
        draft = drafts["random"]
        E, L = target.num_experts, len(target.moe_layer_ids)
        table = ExpertPredictor(table=torch.rand(128, L, E), rows=torch.arange(128), marginal=torch.rand(L, E))
        rows = [prompts[1], prompts[2]]  # 11 and 17 tokens
        hidden, prior, labels, row_of = capture_pairs(target, draft, rows, 3, table, list(range(L)))
        assert hidden.shape[0] == sum((T - 2) + (T - 3) + (T - 4) for T in (11, 17)) == labels.shape[0]
        ids = torch.tensor([rows[1]])
        out = target.forward(ids, output_aux=True)
        ttt = draft.ttt_forward(out.aux_hidden, ids, ttt_steps=3)
        base = (11 - 2) + (11 - 3) + (11 - 4)  # row 1 starts after row 0's pairs
        offset = base + (17 - 2)  # then its step-0 pairs: (t, k = 1) for t = 0.. is the next block
        t = 5
        i = offset + t  # pair (t = 5, k = 1): the guess of token t + 3, read at position 8
        torch.testing.assert_close(hidden[i], ttt.hidden[0, t, 1].float())
        executed = {(layer, int(e)) for layer in range(L) for e in out.topk_ids[layer, 0, t + 3]}
        assert {(layer, e) for layer, e in labels[i].nonzero().tolist()} == executed
        torch.testing.assert_close(prior[i], table.table[rows[1][t + 3]])
        assert row_of[:base].eq(0).all() and row_of[base:].eq(1).all()
    finally:
        target.close()


def test_the_probe_learns_a_context_the_table_cannot_see():
    """One layer, four experts, top-1. Every token's table row is uniform; the expert actually executed is a function
    of the draft state (argmax of a fixed projection). The table recalls a quarter; the probe, fitted from the
    table itself (W = 0, γ = 1), recalls most of the held-out experts."""
    gen = torch.Generator().manual_seed(0)
    M, H, E = 3000, 6, 4
    hidden = torch.randn(M, H, generator=gen)
    chosen = (hidden @ torch.randn(H, E, generator=gen)).argmax(-1)  # (M,)
    labels = torch.nn.functional.one_hot(chosen, E).bool()[:, None, :]  # (M, 1, E)
    prior = torch.full((M, 1, E), 0.25)
    untrained = fit_probe(hidden[:2000], prior[:2000], labels[:2000], epochs=0)
    torch.testing.assert_close(untrained(hidden[:5], prior[:5]), prior[:5])  # starts as the table
    probe = fit_probe(hidden[:2000], prior[:2000], labels[:2000], epochs=30, batch_size=256, lr=2e-2)
    table_q = predictor_quality(prior[2000:], labels[2000:], 1)
    probe_q = predictor_quality(probe(hidden[2000:], prior[2000:]), labels[2000:], 1)
    assert table_q["topk_recall"] < 0.4 and probe_q["topk_recall"] > 0.85
    assert probe_q["bce"] < table_q["bce"]


def test_topk_recall_by_hand():
    probs = torch.tensor([[[0.9, 0.1, 0.5, 0.0]], [[0.2, 0.3, 0.1, 0.8]]])  # (2, 1, 4)
    labels = torch.tensor([[[True, False, False, True]], [[False, True, False, True]]])
    # pair 0: top-2 {0, 2} covers 1 of {0, 3}; pair 1: top-2 {3, 1} covers both
    assert topk_recall(probs, labels, 2) == pytest.approx(0.75)


def test_expert_probe_command_end_to_end(saved_target_and_draft, spec_bench_file, tmp_path, capsys):
    """`vat prep affinity` then `vat prep expert-probe` on a saved tiny target and draft: the file carries the table
    and the probe, EcoSpec loads the probe from it, and `vat eval --tree-policy ecospec --affinity PROBE` still
    decodes the target's own greedy output; bad input stops in one line."""
    from vat.cli import main as cli_main
    from vat.data_prep.chat import prepare_chat
    from vat.eval.run import run_eval

    root, target_dir, draft_dir = saved_target_and_draft
    data = str(tmp_path / "data")
    prepare_chat(write_reversed_chats(tmp_path / "chats.jsonl", 12, 80, 80), target_dir, data, max_length=256,
                 progress=False)
    table = str(tmp_path / "affinity.safetensors")
    assert cli_main(["prep", "affinity", "--target", target_dir, "--data", data, "--output", table]) == 0
    probe_file = str(tmp_path / "probe.safetensors")
    assert cli_main(["prep", "expert-probe", "--draft", draft_dir, "--target", target_dir, "--affinity", table,
                     "--data", data, "--output", probe_file, "--limit", "12", "--steps", "3", "--epochs", "5"]) == 0
    printed = capsys.readouterr().out
    assert "held out" in printed and "top-2 recall table" in printed
    from transformers import AutoConfig

    predictor = ExpertPredictor.load(probe_file, AutoConfig.from_pretrained(target_dir).vocab_size)
    assert predictor.probe is not None and predictor.table.shape[1:] == predictor.marginal.shape
    hidden = torch.randn(3, predictor.probe.weight.shape[1])
    torch.testing.assert_close(predictor([5, 6, 7], hidden), predictor.probe(hidden, predictor([5, 6, 7])))
    out = tmp_path / "eval"
    result = run_eval(target=target_dir, drafts=[("d", draft_dir)], benchmarks=[spec_bench_file], limit=2,
                      max_new_tokens=12, tree="3,3,8", tree_policy="ecospec", ecospec_lambda=2.0, affinity=probe_file,
                      output=str(out), progress=False, plots=False)
    assert result["drafts"]["d"]["ecospec_affinity"] == probe_file
    with open(out / "generations.jsonl") as f:
        outputs = {(r["question_id"], r["draft"]): r["token_ids"] for r in map(json.loads, f)}
    assert sum(label == "d" for _, label in outputs) == 2
    for (qid, label), ids in outputs.items():
        if label == "d":
            assert ids == outputs[(qid, "none")]  # lossless at T = 0
    capsys.readouterr()
    assert cli_main(["prep", "expert-probe", "--draft", draft_dir, "--target", target_dir, "--affinity", table,
                     "--data", data, "--output", probe_file, "--limit", "4", "--holdout", "0.0"]) == 2
    assert "--holdout 0.0 leaves no row to measure the probe on" in capsys.readouterr().err
