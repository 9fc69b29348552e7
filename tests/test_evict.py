"""EVICT (vat/eval/evict.py): its choice against a brute force on a hand-made tree, and lossless greedy decoding with
chain and tree drafting on a tiny OLMoE target, with the verification-cost profile built from the target's own text."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import make_dflash_draft, make_eagle3_draft, olmoe_with_eagle3_drafts
from tiny_models import cached_greedy_reference, greedy_reference, tiny_model

from vat.eval.chain import ChainDraft
from vat.eval.cost import CostModel, draft_shape, get_accelerator, target_shape
from vat.eval.engine import SpeculativeEngine
from vat.eval.evict import Evict, chain_probs, evict_select, monotone, subtree, tree_probs
from vat.eval.tree import DraftTree, TreeSpec
from vat.eval.verify_cost import (
    DraftedUnionRecorder,
    VerifyCostTable,
    build_verify_cost,
    load_verify_cost,
    own_texts,
)
from vat.target import load_target

NEW_TOKENS = 24

# a hand-made tree: node 0 and 1 under the root, 2 and 3 under node 0, 4 under node 2
PARENTS = [-1, -1, 0, 0, 2]
DEPTHS = [1, 1, 2, 2, 3]
PROBS = [0.9, 0.3, 0.6, 0.5, 0.55]


def cost(n: int) -> float:  # C_verify(n) of the hand case
    return 1.0 + 0.3 * n


def test_evict_choice_is_the_hand_computed_argmax_and_the_best_prefix_closed_set():
    # ranked by P: 0 (0.9), 2 (0.6), 4 (0.55), 3 (0.5), 1 (0.3); T_draft = 1, C(n) = 1 + 0.3 n
    #   n = 0: 1 / 2 = 0.500      n = 1: 1.9 / 2.3 = 0.826    n = 2: 2.5 / 2.6 = 0.962
    #   n = 3: 3.05 / 2.9 = 1.052  n = 4: 3.55 / 3.2 = 1.109   n = 5: 3.85 / 3.5 = 1.100
    # so n* = 4: nodes {0, 2, 4, 3}
    assert evict_select(PROBS, PARENTS, DEPTHS, cost, 1.0) == [0, 2, 3, 4]

    def ratio(keep) -> float:
        return (1.0 + sum(PROBS[i] for i in keep)) / (1.0 + cost(len(keep)))

    closed = [keep for r in range(len(PROBS) + 1) for keep in itertools.combinations(range(len(PROBS)), r)
              if all(PARENTS[i] < 0 or PARENTS[i] in keep for i in keep)]
    best = max(closed, key=ratio)
    assert list(best) == [0, 2, 3, 4] and ratio(best) == pytest.approx(3.55 / 3.2)
    # a cheap verifier keeps everything; a verifier that costs the earth keeps nothing (a one-token round)
    assert evict_select(PROBS, PARENTS, DEPTHS, lambda n: 1.0, 1.0) == [0, 1, 2, 3, 4]
    assert evict_select(PROBS, PARENTS, DEPTHS, lambda n: 1.0 + 100 * n, 1.0) == []


def test_acceptance_estimates_are_monotone_along_paths():
    # a verification head may rate a child above its parent: a child is never accepted without its parent
    assert monotone([0.5, 0.8, 0.9, 0.2], [-1, 0, 1, 0]) == [0.5, 0.5, 0.5, 0.2]
    # with the ties broken shallower-first, the top-n of equal estimates is still prefix-closed
    assert evict_select([0.5, 0.8, 0.9], [-1, 0, 1], [1, 2, 3], lambda n: 1.0 + 0.01 * n, 0.0) == [0, 1, 2]
    assert evict_select([0.5, 0.8, 0.9], [-1, 0, 1], [1, 2, 3], lambda n: 1.0 + 0.1 * n + 5.0 * (n >= 2), 0.0) == [0]
    chain = ChainDraft(tokens=torch.tensor([5, 6, 7]), q=None, probs=[0.8, 0.5, 0.5])
    assert chain_probs(chain) == pytest.approx([0.8, 0.4, 0.2])
    # a tree's path probability is exp(score); with a head, its survival probability scaled by q / q(best sibling)
    tree = DraftTree(tokens=[1, 2, 3], parents=[-1, -1, 0], depths=[1, 1, 2],
                     scores=[torch.log(torch.tensor(0.6)).item(), torch.log(torch.tensor(0.3)).item(),
                             torch.log(torch.tensor(0.6 * 0.5)).item()])
    assert tree_probs(tree) == pytest.approx([0.6, 0.3, 0.3])
    tree.vh = [0.7, 0.7, 0.4]
    assert tree_probs(tree) == pytest.approx([0.7, 0.35, 0.4])
    sub = subtree(tree, [0, 2])
    assert sub.parents == [-1, 0] and sub.tokens == [1, 3] and sub.vh == [0.7, 0.4]


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    model, target, drafts, prompts = olmoe_with_eagle3_drafts(torch.Generator().manual_seed(1234))
    with torch.no_grad():  # the rigged draft, confident: same proposals (argmax), probabilities near 1
        drafts["rigged"].lm_head.weight.mul_(200.0)
    model_cost = CostModel(get_accelerator("h200"), target_shape(target))
    table = build_verify_cost(target, own_texts(target, prompts, NEW_TOKENS), [1, 2, 4, 8, 16], cost=model_cost)
    yield model, target, drafts, prompts, model_cost, table
    target.close()


def test_verify_cost_profile_grows_with_width_and_round_trips(setup, tmp_path):
    _, target, _, _, _, table = setup
    assert table.widths == [1, 2, 4, 8, 16]
    means = [sum(u) / len(u) for u in table.union]
    assert means[0] == target.top_k  # one token: its own top-k
    assert all(a <= b for a, b in zip(means, means[1:])) and means[-1] <= target.num_experts
    assert all(a < b for a, b in zip(table.modeled_seconds, table.modeled_seconds[1:]))
    assert len(table.measured_seconds) == 5 and table.accelerator == "h200"
    # interpolation between profiled widths, the last slope beyond them
    assert table.union_at(3) == pytest.approx([(a + b) / 2 for a, b in zip(table.union[1], table.union[2])])
    assert table.union_at(20) == pytest.approx([b + 0.5 * (b - a) for a, b in zip(table.union[3], table.union[4])])
    import json

    (tmp_path / "profile.json").write_text(json.dumps({"verify_cost": table.to_dict()}))
    assert load_verify_cost(str(tmp_path), len(target.moe_layer_ids)).union == table.union
    from vat.errors import VatError

    with pytest.raises(VatError, match="another target"):
        load_verify_cost(str(tmp_path / "profile.json"), 5)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(VatError, match="no `verify_cost` table"):
        load_verify_cost(str(tmp_path / "other.json"))


@pytest.mark.parametrize("tree", [None, TreeSpec(3, 4, 12)], ids=["chain", "tree"])
def test_evict_greedy_decoding_is_lossless(setup, tree):
    model, target, drafts, prompts, model_cost, table = setup
    full = tree.total_tokens if tree else 6
    truncated = accepted = 0
    for name, draft in drafts.items():
        evict = Evict(model_cost, table, draft_shape(draft))
        for prompt in prompts:
            engine = SpeculativeEngine(target, draft, steps=6, tree=tree, policies=[evict], max_new_tokens=NEW_TOKENS)
            gen = engine.generate(prompt)
            assert gen.token_ids == cached_greedy_reference(model, prompt, NEW_TOKENS), (name, prompt)
            truncated += sum(r.drafted < full for r in gen.rounds)
            assert all(r.drafted_depth >= r.depth for r in gen.rounds)  # what the draft ran, before the cut
            if name == "rigged":
                accepted += sum(r.accepted for r in gen.rounds)
    assert truncated > 0  # EVICT really cut blocks short
    assert accepted > 0  # and kept drafts that the target accepted


def test_evict_uses_the_verification_head_and_stays_lossless(setup):
    model, target, _, prompts, model_cost, table = setup
    draft = make_eagle3_draft(model, target, rigged=True, vh=True)
    reference = cached_greedy_reference(model, prompts[0], NEW_TOKENS)
    drafted = {}
    for bias in (-6.0, 6.0):  # the head says "rejected" / "accepted" everywhere
        with torch.no_grad():
            draft.verification_head.weight.zero_()
            draft.verification_head.bias.fill_(bias)
        for tree in (None, TreeSpec(2, 3, 6)):
            engine = SpeculativeEngine(target, draft, steps=5, tree=tree, policies=[Evict(model_cost, table,
                                       draft_shape(draft))], max_new_tokens=NEW_TOKENS)
            gen = engine.generate(prompts[0])
            assert gen.token_ids == reference
            drafted[(bias, tree is None)] = sum(r.drafted for r in gen.rounds) / len(gen.rounds)
    for chain in (True, False):
        assert drafted[(-6.0, chain)] < drafted[(6.0, chain)]


def test_evict_truncates_a_block_chain_with_its_q_rows():
    table = VerifyCostTable(widths=[1, 8], union=[[2.0], [8.0]])
    from vat.eval.cost import ModelShape

    shape = ModelShape(dense_params=10, dense_matmul_params=10, expert_params=[1000], top_k=2, kv_per_token=0,
                       attn_flops_per_key=0)
    evict = Evict(CostModel(get_accelerator("h200"), shape), table)
    draft = ChainDraft(tokens=torch.tensor([4, 5, 6]), q=torch.rand(3, 9), probs=[0.99, 0.01, 0.9])
    out = evict.cut_chain(draft, context=3, mode="block")
    assert out.tokens.tolist() == [4] and out.q.shape == (1, 9) and out.probs == [0.99]


def test_evict_under_a_budget_and_when_sampling(setup):
    """A budget caps the union EVICT prices; sampling through truncated chains and trees keeps working."""
    model, target, drafts, prompts, model_cost, table = setup
    capped = Evict(model_cost, table, budget=3)
    assert all(u <= 3.0 for u in capped.union(16)) and max(Evict(model_cost, table).union(16)) > 3.0
    for tree in (None, TreeSpec(3, 3, 8)):
        engine = SpeculativeEngine(target, drafts["rigged"], steps=5, tree=tree, temperature=1.0, budget=3,
                                   policies=[Evict(model_cost, table, draft_shape(drafts["rigged"]), budget=3)],
                                   max_new_tokens=NEW_TOKENS)
        gen = engine.generate(prompts[1], torch.Generator().manual_seed(0))
        assert len(gen.token_ids) == NEW_TOKENS and all(max(r.union) <= 3 for r in gen.rounds)


def test_evict_on_dflash_blocks_is_lossless():
    """EVICT truncates DFlash blocks (the drafter's per-slot probabilities) and the output stays the greedy decode."""
    model = tiny_model("olmoe", seed=2, vocab_size=16, num_layers=4)
    target = load_target(model, device="cpu")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 16, (n,), generator=gen).tolist() for n in (5, 11)]
    model_cost = CostModel(get_accelerator("h200"), target_shape(target))
    table = build_verify_cost(target, own_texts(target, prompts, NEW_TOKENS), [1, 2, 3, 5], cost=model_cost)
    drafted = []
    for rigged in (True, False):
        draft = make_dflash_draft(model, target, rigged=rigged)
        engine = SpeculativeEngine(target, draft, policies=[Evict(model_cost, table, draft_shape(draft))],
                                   max_new_tokens=NEW_TOKENS)
        assert engine.mode == "block"
        for prompt in prompts:
            out = engine.generate(prompt)
            assert out.token_ids == greedy_reference(model, prompt, NEW_TOKENS), (rigged, prompt)
            drafted += [r.drafted for r in out.rounds]
            assert all(r.drafted_depth == 4 for r in out.rounds)  # block 5: four drafts ran every round
    assert min(drafted) < 4  # EVICT cut some blocks
    target.close()


def test_tree_rounds_record_every_level_the_draft_drafted(setup):
    """The draft runs `depth` levels whatever the selection keeps: the cost model prices those forwards."""
    _, target, drafts, prompts, _, _ = setup
    engine = SpeculativeEngine(target, drafts["random"], tree=TreeSpec(4, 5, 3), max_new_tokens=12)
    rounds = engine.generate(prompts[0]).rounds
    assert all(r.drafted_depth == 5 for r in rounds) and max(r.depth for r in rounds) < 5  # 3 nodes of 5 levels


def test_drafted_union_recorder_by_hand():
    """Two MoE layers, E = 4, top-2; a 3-position block (root, then two drafts in the tree's order) and a 2-position
    one. Layer 0 of block 1 routes {0, 1}, {1, 2}, {1, 4 = dropped slot}: the first w positions cover 2, 3, 3 experts;
    layer 1 routes {3, 2} everywhere: 2, 2, 2. Block 2 adds width 1 and 2 samples: layer 0 {0, 1} then {2, 3} (2, 4),
    layer 1 {0, 1}, {0, 1} (2, 2). Means: w = 1: (2, 2), w = 2: (3.5, 2), w = 3: (3, 2) (one block)."""
    rec = DraftedUnionRecorder(num_experts=4)
    block1 = torch.tensor([[[0, 1], [1, 2], [1, 4]], [[3, 2], [3, 2], [2, 3]]])  # (L' = 2, T = 3, k = 2)
    block2 = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [1, 0]]])  # (2, 2, 2)
    rec.cut_tree(None, 10, 2)
    rec.executed([], block1)
    rec.cut_chain(None, 20, "chain")
    rec.executed([], block2)
    table = rec.table(source="hand")
    assert table.widths == [1, 2, 3] and table.n_texts == 2 and table.context == 15.0
    assert table.union == [[2.0, 2.0], [3.5, 2.0], [3.0, 2.0]]
    assert table.modeled_seconds is None and DraftedUnionRecorder(4).table() is None
