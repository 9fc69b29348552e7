"""EcoSpec (``--tree-policy ecospec``, docs/verification_policies.md): at λ = 0 its selection is the confidence selection on
real drafted trees (same nodes, same order); at any λ it stays prefix-closed, follows the expected-new-experts cost
on a hand pool, and greedy decoding stays lossless (token for token the target's own greedy decode)."""

from __future__ import annotations

import pytest
import torch
from helpers import olmoe_with_eagle3_drafts
from tiny_models import cached_greedy_reference

from vat.data_prep.affinity import affinity_from_routing
from vat.errors import VatError
from vat.eval.ecospec import CostAwareExpansion, EcoSpec, ExpertPredictor, ecospec_nodes
from vat.eval.engine import SpeculativeEngine
from vat.eval.tree import TreeSpec, _Node, best_candidates, best_nodes

NEW_TOKENS = 24
TREES = [TreeSpec(2, 3, 5), TreeSpec(4, 4, 12), TreeSpec(3, 6, 20)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    gen = torch.Generator().manual_seed(1234)
    model, target, drafts, prompts = olmoe_with_eagle3_drafts(gen)
    # the expert predictor: an affinity table of the target's own routing over random text (`vat prep affinity`'s
    # computation), rows = target ids
    text = torch.randint(3, 128, (8, 32), generator=gen)
    routing = target.forward(text, output_aux=False).topk_ids  # (L', 8, 32, k)
    table, _ = affinity_from_routing(text, routing, None, target.vocab_size, target.num_experts)
    predictor = ExpertPredictor(table=table, rows=torch.arange(target.vocab_size), marginal=table.mean(0))
    yield model, target, drafts, prompts, predictor
    target.close()


def _pools(target, draft, prompt, tree, ecospec=None):
    """Decode with the engine and record every round's candidate pool, root and chosen nodes."""
    from vat.eval import engine as engine_module

    records = []
    build = engine_module.build_tree

    def recording(state, head, spec, vh_threshold=None, select=None, expand=None):
        def keep(pool, total):
            chosen = (select or best_nodes)(pool, total)
            records.append((list(pool), total, chosen))
            return chosen

        return build(state, head, spec, vh_threshold=vh_threshold, select=keep, expand=expand)

    engine_module.build_tree = recording
    try:
        gen = SpeculativeEngine(target, draft, tree=tree, policies=[ecospec] if ecospec is not None else [],
                                max_new_tokens=NEW_TOKENS).generate(prompt)
    finally:
        engine_module.build_tree = build
    return gen, records


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_lambda_zero_is_confidence_selection_on_real_trees(setup, tree):
    _, target, drafts, prompts, predictor = setup
    rounds, differ = 0, 0
    for draft in drafts.values():
        for prompt in prompts:
            _, records = _pools(target, draft, prompt, tree)
            for pool, total, chosen in records:
                root = 7  # any root: at λ = 0 the cost must not matter
                assert ecospec_nodes(pool, total, predictor, root, 0.0) == chosen
                heavy = ecospec_nodes(pool, total, predictor, root, 50.0)
                assert len(heavy) == min(total, len(pool))
                picked = set(heavy)
                assert all(pool[v].parent < 0 or pool[v].parent in picked for v in heavy)  # prefix-closed
                rounds += 1
                differ += set(heavy) != set(chosen)
    assert rounds > 10 and differ > 0  # the pools are real and a heavy λ does change the selection


def test_lambda_zero_engine_decodes_exactly_like_confidence(setup):
    _, target, drafts, prompts, predictor = setup
    tree = TreeSpec(3, 4, 10)
    for draft in drafts.values():
        plain, _ = _pools(target, draft, prompts[1], tree)
        eco, _ = _pools(target, draft, prompts[1], tree, EcoSpec(predictor, lam=0.0))
        assert eco.token_ids == plain.token_ids
        assert [vars(r) for r in eco.rounds] == [vars(r) for r in plain.rounds]


@pytest.mark.parametrize("lam", [2.0, 1e3])
def test_ecospec_greedy_decoding_is_lossless(setup, lam):
    model, target, drafts, prompts, predictor = setup
    accepted = 0
    for name, draft in drafts.items():
        for tree in TREES[1:]:
            for prompt in prompts[1:]:
                engine = SpeculativeEngine(target, draft, tree=tree, policies=[EcoSpec(predictor, lam=lam)],
                                           max_new_tokens=NEW_TOKENS)
                gen = engine.generate(prompt)
                assert gen.token_ids == cached_greedy_reference(model, prompt, NEW_TOKENS), (name, tree, prompt)
                accepted += sum(r.accepted for r in gen.rounds)
    assert accepted > 0


def test_ecospec_cost_on_a_hand_pool():
    """E = 4, one layer; the root token reads as expert 0. Two root children with equal scores: node 1 routes to
    expert 0 (already covered, cost 0), node 0 to expert 3 (cost 1). At λ = 1 node 1 comes first, then its cheaper
    child 2 (cost 0.5) before node 0, and node 3 (expert 3) costs nothing once node 0 has covered expert 3."""
    h = torch.zeros(1)
    table = torch.zeros(8, 1, 4)
    table[1, 0, 0] = 1.0  # root token 1 -> expert 0
    table[2, 0, 0] = 1.0  # token 2 -> expert 0 (covered)
    table[3, 0, 3] = 1.0  # token 3 -> expert 3 (new)
    table[4, 0, 1] = 0.5  # token 4 -> expert 1 half the time
    table[4, 0, 0] = 0.5
    predictor = ExpertPredictor(table=table, rows=torch.arange(8), marginal=table.mean(0))
    pool = [
        _Node(3, -1, 1, -0.50, h),  # 0: new expert, cost 1
        _Node(2, -1, 1, -0.50, h),  # 1: covered, cost 0
        _Node(4, 1, 2, -0.70, h),  # 2: child of 1, cost 0.5
        _Node(3, 1, 2, -0.60, h),  # 3: child of 1, cost 1 (until pool 0 is in)
    ]
    assert best_nodes(pool, 4) == [0, 1, 3, 2]
    assert ecospec_nodes(pool, 4, predictor, 1, 0.0) == [0, 1, 3, 2]
    # λ = 1: keys 0: -1.5, 1: -0.5 -> 1; then 0: -1.5, 2: -1.2, 3: -1.6 -> 2; then 0: -1.5 vs 3: -1.6 -> 0 ... and
    # once token 3's expert is covered, node 3 costs nothing: -0.6
    assert ecospec_nodes(pool, 4, predictor, 1, 1.0) == [1, 2, 0, 3]
    assert ecospec_nodes(pool, 2, predictor, 1, 1.0) == [1, 2]
    with pytest.raises(VatError, match="ecospec-lambda"):
        EcoSpec(predictor, lam=-1.0)


def test_cost_aware_expansion_on_a_hand_level():
    """The hand pool's table (root token 1 -> expert 0). A level of four candidates: scores -0.5 (token 3: new expert
    3), -0.5 (token 2: covered), -0.55 (token 4: half new), -0.6 (token 3 again). Confidence expands [0, 1] (top 2,
    ties to the earlier). At λ = 1 the covered node 1 goes first (key -0.5), then node 2 (-1.05) before node 0 (-1.5).
    The buffer carries over to the next level: once a token-3 node is expanded, expert 3 costs nothing."""
    h = torch.zeros(1)
    table = torch.zeros(8, 1, 4)
    table[1, 0, 0] = table[2, 0, 0] = table[3, 0, 3] = 1.0
    table[4, 0, 1] = table[4, 0, 0] = 0.5
    predictor = ExpertPredictor(table=table, rows=torch.arange(8), marginal=table.mean(0))
    pool = [_Node(3, -1, 1, -0.5, h), _Node(2, -1, 1, -0.5, h), _Node(4, -1, 1, -0.55, h), _Node(3, -1, 1, -0.6, h)]
    level = [0, 1, 2, 3]
    assert best_candidates(pool, level, 2) == [0, 1]
    assert CostAwareExpansion(predictor, 1, 0.0)(pool, level, 2) == [0, 1]  # λ = 0: confidence's picks and order
    assert CostAwareExpansion(predictor, 1, 1e-9)(pool, level, 2) == [1, 0]  # a vanishing λ breaks the tie by cost
    expand = CostAwareExpansion(predictor, 1, 1.0)
    assert expand(pool, level, 2) == [1, 2]
    # next level: a token-3 child (-0.9) against a token-2 child (-1.0): expert 3 is still new (cost 1) -> token 2
    pool += [_Node(3, 1, 2, -0.9, h), _Node(2, 1, 2, -1.0, h)]
    assert expand(pool, [4, 5], 1) == [5]
    # expanding a token-3 node covers expert 3 for what follows in the same tree
    assert expand(pool, [4], 1) == [4] and float(expand.miss[0, 3]) == 0.0
    assert EcoSpec(predictor, lam=0.0).expander(1) is None  # λ = 0 leaves the expansion to confidence


@pytest.mark.parametrize("tree", TREES[1:], ids=str)
def test_a_heavy_lambda_changes_what_the_tree_expands(setup, tree):
    """Real drafted trees: with λ = 50 the pools the final selection sees differ from confidence expansion's (the
    cost entered the expansion, not only the selection), and every pool is still a tree (parents expanded first)."""
    _, target, drafts, prompts, predictor = setup
    changed = 0
    for draft in drafts.values():
        for prompt in prompts[1:]:
            _, plain = _pools(target, draft, prompt, tree)
            _, heavy = _pools(target, draft, prompt, tree, EcoSpec(predictor, lam=50.0))
            for pool, _, _ in heavy:
                assert all(node.parent < 0 or pool[node.parent].depth == node.depth - 1 for node in pool)
            first = [(tuple((n.token, n.parent) for n in p)) for p, _, _ in plain[:1]]
            again = [(tuple((n.token, n.parent) for n in p)) for p, _, _ in heavy[:1]]
            changed += first != again  # the first round has the same context: only the expansion differs
    assert changed > 0


def test_predictor_reads_a_draft_table_through_its_vocab(tmp_path):
    from safetensors.torch import save_file

    vocab, t2d = 10, torch.tensor([0, 1, 0, 1, 1, 0, 0, 0, 1, 0], dtype=torch.bool)  # draft ids 0..3 = target 1,3,4,8
    table = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3) / 24
    save_file({"affinity": table}, str(tmp_path / "affinity.safetensors"))
    pred = ExpertPredictor.load(str(tmp_path), vocab, t2d)
    got = pred([4, 0, 8])
    assert torch.equal(got[0], table[2]) and torch.equal(got[2], table[3])
    assert torch.allclose(got[1], table.mean(0))  # no row: the marginal
    save_file({"affinity": torch.zeros(7, 2, 3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(VatError, match="7 rows"):
        ExpertPredictor.load(str(tmp_path / "bad.safetensors"), vocab, t2d)
