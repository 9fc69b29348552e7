"""Speculative-decoding engine: lossless greedy decoding (chain, tree), budgets on the verification forward, the
verification-head stop, and the target-cache helpers, on tiny fp32 OLMoE targets."""

from __future__ import annotations

import pytest
import torch
from helpers import make_eagle3_draft, olmoe_with_eagle3_drafts
from tiny_models import cached_greedy_reference

from vat.errors import VatError
from vat.eval.engine import SpeculativeEngine
from vat.eval.tree import DraftTree, TreeSpec, _Node, _select
from vat.target.cache import crop_cache, new_cache, select_cache_positions, tree_attention_mask

NEW_TOKENS = 24
MODES = [
    ("chain", 1, None),
    ("chain", 3, None),
    ("chain", 6, None),
    ("tree", None, TreeSpec(2, 3, 5)),
    ("tree", None, TreeSpec(4, 4, 12)),
    ("tree", None, TreeSpec(3, 6, 20)),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    model, target, drafts, prompts = olmoe_with_eagle3_drafts(torch.Generator().manual_seed(1234))
    yield model, target, drafts, prompts
    target.close()


def engine_for(target, draft, mode, steps, tree, **kw) -> SpeculativeEngine:
    return SpeculativeEngine(target, draft, steps=steps or 1, tree=tree, max_new_tokens=kw.pop("max_new", NEW_TOKENS), **kw)


def test_autoregressive_baseline_is_the_greedy_decode(setup):
    model, target, _, prompts = setup
    engine = SpeculativeEngine(target, None, max_new_tokens=NEW_TOKENS)
    gen = engine.generate(prompts[1])
    assert gen.token_ids == cached_greedy_reference(model, prompts[1], NEW_TOKENS)
    assert len(gen.rounds) == NEW_TOKENS - 1 and gen.target_forwards == NEW_TOKENS
    assert all(r.union == [target.top_k] * len(target.moe_layer_ids) for r in gen.rounds)


@pytest.mark.parametrize("mode,steps,tree", MODES, ids=[f"{m}-{s or t}" for m, s, t in MODES])
def test_greedy_speculative_decoding_is_lossless(setup, mode, steps, tree):
    model, target, drafts, prompts = setup
    accepted, longest = {}, 0
    for name, draft in drafts.items():
        for prompt in prompts[:2] if name == "random" else prompts:
            engine = engine_for(target, draft, mode, steps, tree)
            assert engine.mode == mode
            gen = engine.generate(prompt)
            assert gen.token_ids == cached_greedy_reference(model, prompt, NEW_TOKENS), (name, prompt)
            assert sum(r.committed for r in gen.rounds) == NEW_TOKENS - 1
            for r in gen.rounds:
                assert 0 <= r.accepted <= r.depth and r.reached <= r.depth
            accepted[name] = accepted.get(name, 0) + sum(r.accepted for r in gen.rounds)
            longest = max([longest] + [r.accepted for r in gen.rounds])
    # the rigged draft must really exercise the accept path, several drafts deep (cache crop / compaction after a > 1)
    assert accepted["rigged"] > 0
    assert longest >= min(2, steps or tree.depth)


def test_lossless_with_eos_and_budget_above_union(setup):
    model, target, drafts, prompts = setup
    reference = cached_greedy_reference(model, prompts[2], NEW_TOKENS)
    eos = reference[10]
    stop = reference.index(eos) + 1
    for tree in (None, TreeSpec(3, 4, 10)):
        engine = SpeculativeEngine(
            target, drafts["rigged"], steps=4, tree=tree, budget=target.num_experts, max_new_tokens=NEW_TOKENS,
            eos_token_ids=[eos],
        )
        assert engine.generate(prompts[2]).token_ids == reference[:stop]


@pytest.mark.parametrize("policy", ["substitute", "truncate"])
@pytest.mark.parametrize("tree", [None, TreeSpec(3, 3, 8)], ids=["chain", "tree"])
def test_budget_caps_the_union_of_every_verification_round(setup, policy, tree):
    _, target, drafts, prompts = setup
    B = 2
    recorded: list[torch.Tensor] = []
    forward = target.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("budget") is not None:
            recorded.append(out.topk_ids)
        return out

    natural = SpeculativeEngine(target, drafts["random"], steps=5, tree=tree, max_new_tokens=12)
    natural_max = max(max(r.union) for r in natural.generate(prompts[0]).rounds)
    assert natural_max > B  # otherwise the budget would be vacuous

    target.forward = recording
    try:
        engine = SpeculativeEngine(target, drafts["random"], steps=5, tree=tree, budget=B, policy=policy,
                                   max_new_tokens=12)
        gen = engine.generate(prompts[0])
    finally:
        del target.forward
    assert len(recorded) == len(gen.rounds)
    for ids, r in zip(recorded, gen.rounds):  # (L', 1, T, k) executed ids of each verification forward
        for layer in range(ids.shape[0]):
            used = ids[layer].flatten()
            distinct = torch.unique(used[used != target.num_experts])
            assert distinct.numel() <= B
            assert distinct.numel() == r.union[layer]


def test_verification_head_threshold_stops_drafting(setup):
    model, target, _, prompts = setup
    draft = make_eagle3_draft(model, target, rigged=True, vh=True)
    reference = cached_greedy_reference(model, prompts[0], NEW_TOKENS)
    for bias, expect_drafted in ((-30.0, 0), (30.0, 4)):
        with torch.no_grad():
            draft.verification_head.weight.zero_()
            draft.verification_head.bias.fill_(bias)
        for tree in (None, TreeSpec(2, 2, 4)):
            engine = SpeculativeEngine(target, draft, steps=4, tree=tree, vh_threshold=0.5, max_new_tokens=NEW_TOKENS)
            gen = engine.generate(prompts[0])
            assert gen.token_ids == reference
            assert {r.drafted for r in gen.rounds} == {expect_drafted}


def test_draft_confidence_stops_each_chain_after_its_first_unconfident_token(setup, monkeypatch):
    """The rule as transformers' ConfidenceCriteria states it, applied to the full chain of every round: keep the
    drafts up to and including the first whose draft probability is below the threshold. Lossless either way."""
    import vat.eval.engine as engine_module

    model, target, drafts, prompts = setup
    real, kept = engine_module.draft_chain, []

    def checked(state, head, steps, *, vh_threshold=None, confidence=None, generator=None):
        full = real(state, head, steps, vh_threshold=vh_threshold, generator=generator)  # the draft's cache is restored
        keep = next((i + 1 for i, p in enumerate(full.probs) if p < confidence), len(full.probs))
        cut = real(state, head, steps, vh_threshold=vh_threshold, confidence=confidence, generator=generator)
        assert cut.tokens.tolist() == full.tokens[:keep].tolist() and cut.probs == full.probs[:keep]
        kept.append(keep)
        return cut

    def recording(state, head, steps, *, vh_threshold=None, confidence=None, generator=None):
        chain = real(state, head, steps, vh_threshold=vh_threshold, generator=generator)
        probs.extend(chain.probs)
        return chain

    for name, draft in drafts.items():
        probs = []
        monkeypatch.setattr(engine_module, "draft_chain", recording)
        SpeculativeEngine(target, draft, steps=6, max_new_tokens=NEW_TOKENS).generate(prompts[0])
        threshold = sorted(probs)[len(probs) // 2]  # the median drafted probability: some chains stop, some run on
        monkeypatch.setattr(engine_module, "draft_chain", checked)
        kept.clear()
        gen = SpeculativeEngine(target, draft, steps=6, draft_confidence=threshold,
                                max_new_tokens=NEW_TOKENS).generate(prompts[0])
        assert gen.token_ids == cached_greedy_reference(model, prompts[0], NEW_TOKENS), name
        assert [r.drafted for r in gen.rounds] == kept
        assert min(kept) < 6 and len(set(kept)) > 1, (name, kept)  # the rule stopped chains at different depths


def test_draft_confidence_is_refused_where_there_is_no_chain_to_stop(setup):
    _, target, drafts, _ = setup
    with pytest.raises(VatError, match="--draft-confidence"):
        SpeculativeEngine(target, drafts["random"], tree=TreeSpec(2, 2, 4), draft_confidence=0.5)
    with pytest.raises(VatError, match="--draft-confidence"):
        SpeculativeEngine(target, None, draft_confidence=0.5)


def test_cache_compaction_matches_full_forward(setup):
    _, target, _, prompts = setup
    ids = torch.tensor([prompts[2]])  # (1, 17)
    full = target.forward(ids).logits  # (1, 17, V)
    cache = new_cache()
    target.forward(ids[:, :8], past_key_values=cache, use_cache=True)
    # a tree over positions 8..10: root ids[8]; children ids[9] (kept) and a decoy; ids[10] under ids[9]
    block = torch.tensor([[int(ids[0, 8]), int(ids[0, 9]), 5, int(ids[0, 10])]])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = tree_attention_mask(anc, 8, torch.float32)
    assert mask.shape == (1, 1, 4, 12) and mask[0, 0, 3, 10] < -1e30 and mask[0, 0, 3, 9] == 0
    out = target.forward(block, mask, position_ids=torch.tensor([[8, 9, 9, 10]]), past_key_values=cache,
                         use_cache=True)
    torch.testing.assert_close(out.logits[0, [0, 1, 3]], full[0, 8:11], atol=1e-5, rtol=1e-5)
    select_cache_positions(cache, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11]))
    nxt = target.forward(ids[:, 11:13], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(nxt.logits[0], full[0, 11:13], atol=1e-5, rtol=1e-5)
    crop_cache(cache, 12)
    again = target.forward(ids[:, 12:14], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(again.logits[0], full[0, 12:14], atol=1e-5, rtol=1e-5)


def test_tree_selection_is_ancestor_closed_and_topological():
    h = torch.zeros(1)
    # scores decrease along paths; ties between a parent and its child must keep the parent
    pool = [
        _Node(10, -1, 1, -0.5, h), _Node(11, -1, 1, -1.0, h), _Node(12, 0, 2, -0.5, h), _Node(13, 0, 2, -2.0, h),
        _Node(14, 2, 3, -0.6, h), _Node(15, 1, 2, -1.1, h),
    ]
    for total in range(1, len(pool) + 1):
        tree = _select(pool, total)
        assert len(tree) == total
        for i, parent in enumerate(tree.parents):
            assert parent < i and (parent == -1 or tree.depths[parent] == tree.depths[i] - 1)
    assert _select(pool, 3).tokens == [10, 12, 14]  # -0.5, -0.5 (tie: the parent first), -0.6
    tree = _select(pool, 6)
    assert tree.tokens == [10, 11, 12, 13, 15, 14]  # topological: by depth
    anc = tree.ancestors()  # block index = node index + 1; 0 = root
    assert anc.shape == (7, 7) and bool(anc[:, 0].all())
    assert anc[6].nonzero().flatten().tolist() == [0, 1, 3, 6]  # 14 <- 12 <- 10 <- root
    assert anc[5].nonzero().flatten().tolist() == [0, 2, 5]  # 15 <- 11 <- root


def test_tree_children_order_and_layout():
    tree = DraftTree(tokens=[7, 8, 9, 4], parents=[-1, -1, 0, 0], depths=[1, 1, 2, 2], scores=[-1.0, -0.5, -3, -2])
    kids = tree.children()
    assert kids[0] == [2, 1] and kids[1] == [4, 3] and kids[2] == []
    assert tree.block_depths().tolist() == [0, 1, 1, 2, 2]
