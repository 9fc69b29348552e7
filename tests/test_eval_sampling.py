"""Rejection sampling keeps the target's distribution: exact enumeration of one acceptance step with given p and q,
Monte-Carlo checks of the samplers themselves, and a chi-square test of whole T = 1 generations on a tiny vocabulary."""

from __future__ import annotations

import pytest
import torch
from helpers import chi_square, chi_square_critical
from tiny_models import tiny_model

from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.eval.engine import SpeculativeEngine
from vat.eval.sampling import (
    accept_chain_greedy,
    accept_chain_sampling,
    accept_children_sampling,
    acceptance_probability,
    residual_distribution,
    sample,
)
from vat.eval.tree import TreeSpec
from vat.target import load_target

V = 6


pytestmark = pytest.mark.usefixtures("one_thread")


def _distributions(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(p, q) pairs: random, with zeros on either side, identical, disjoint supports, and a point-mass draft."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda: torch.softmax(torch.randn(V, generator=g) * 2, dim=0)
    p, q = rand(), rand()
    p_zero = p.clone()
    p_zero[:2] = 0
    q_zero = q.clone()
    q_zero[3:] = 0
    disjoint_p = torch.tensor([0.5, 0.5, 0, 0, 0, 0])
    disjoint_q = torch.tensor([0, 0, 0.25, 0.25, 0.25, 0.25])
    point = torch.zeros(V)
    point[4] = 1.0
    pairs = [(p, q), (p_zero / p_zero.sum(), q), (p, q_zero / q_zero.sum()), (p, p.clone()), (disjoint_p, disjoint_q),
             (p, point)]
    return [(a.double() / a.double().sum(), b.double() / b.double().sum()) for a, b in pairs]


# ---- exact enumeration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_chain_step_output_distribution_is_p_exactly(seed):
    for p, q in _distributions(seed):
        out = torch.zeros(V, dtype=torch.float64)
        for d in range(V):  # the draft token, drawn from q
            if q[d] == 0:
                continue
            alpha = acceptance_probability(p, q, d)
            out[d] += q[d] * alpha
            out += q[d] * (1 - alpha) * residual_distribution(p, q).double()
        torch.testing.assert_close(out, p, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_tree_node_rule_output_distribution_is_p_exactly(seed):
    """Children tried in order, child c accepted w.p. p_r(c) / sum(p_r), else removed; then draw from p_r."""
    for p, _ in _distributions(seed):
        for children in ([4], [2, 0, 5], [5, 4, 3, 2, 1], list(range(V))):
            out = torch.zeros(V, dtype=torch.float64)
            residual, reach = p.clone(), 1.0
            for c in children:
                total = float(residual.sum())
                if total <= 0:
                    break
                accept = float(residual[c]) / total
                out[c] += reach * accept
                reach *= 1 - accept
                residual[c] = 0
            if reach > 0 and float(residual.sum()) > 0:
                out += reach * residual / residual.sum()
            torch.testing.assert_close(out, p, atol=1e-12, rtol=0)


def test_greedy_chain_acceptance():
    target = torch.tensor([5, 7, 9, 2])
    assert accept_chain_greedy(target, torch.tensor([5, 7, 9])) == 3
    assert accept_chain_greedy(target, torch.tensor([5, 8, 9])) == 1
    assert accept_chain_greedy(target, torch.tensor([4, 7, 9])) == 0
    assert accept_chain_greedy(target[:1], torch.zeros(0, dtype=torch.long)) == 0


# ---- the samplers themselves (Monte Carlo) -----------------------------------------------------------------------


def test_chain_sampler_commits_tokens_distributed_as_p():
    """accept_chain_sampling over K = 2: the first committed token ~ p_0; given d_1 accepted, the next ~ p_1."""
    g = torch.Generator().manual_seed(0)
    p0, q0 = _distributions(5)[0]
    p1, q1 = _distributions(6)[0]
    p = torch.stack([p0, p1, p1]).float()
    q = torch.stack([q0, q1]).float()
    n = 6000
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(n):
        drafts = torch.tensor([sample(q[0], g), sample(q[1], g)])
        a, token = accept_chain_sampling(p, q, drafts, g)
        committed = drafts[:a].tolist() + [token]
        first[committed[0]] += 1
        if a >= 1:
            second[committed[1]] += 1
    for counts, probs in ((first, p0), (second, p1)):
        stat, df = chi_square(counts, probs)
        assert stat < chi_square_critical(df), (stat, df)


def test_tree_sampler_commits_tokens_distributed_as_p():
    g = torch.Generator().manual_seed(1)
    p, _ = _distributions(7)[0]
    children = [int(i) for i in torch.argsort(p)[:3]]  # deliberately the least likely tokens first
    counts = torch.zeros(V)
    n = 6000
    for _ in range(n):
        index, residual = accept_children_sampling(p.float(), children, g)
        token = children[index] if index is not None else sample(residual, g)
        counts[token] += 1
    stat, df = chi_square(counts, p)
    assert stat < chi_square_critical(df), (stat, df)


# ---- whole generations through the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vocab_setup():
    vocab = 8
    model = tiny_model("olmoe", seed=3, vocab_size=vocab)
    with torch.no_grad():  # flatten the random target so every token has real mass
        model.lm_head.weight.mul_(0.3)
    target = load_target(model, device="cpu")
    torch.manual_seed(0)
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=vocab, aux_layer_ids=target.aux_layer_ids)
    draft = Eagle3Drafter(cfg, target.embed_tokens().weight).eval()
    prompt = [3, 5, 7, 4]
    with torch.no_grad():  # the exact joint law of the first two generated tokens
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), dim=0)  # (V,)
        p2 = torch.stack([
            torch.softmax(model(torch.tensor([prompt + [x]])).logits[0, -1].double(), dim=0) for x in range(vocab)
        ])  # (V, V)
    yield target, draft, prompt, p1[:, None] * p2
    target.close()


@pytest.mark.parametrize("tree", [None, TreeSpec(3, 2, 4)], ids=["chain", "tree"])
def test_speculative_sampling_matches_target_distribution(tiny_vocab_setup, tree):
    target, draft, prompt, joint = tiny_vocab_setup
    vocab = joint.shape[0]
    engine = SpeculativeEngine(target, draft, steps=2, tree=tree, temperature=1.0, max_new_tokens=2)
    counts = torch.zeros(vocab, vocab)
    accepted = rejected = 0
    n = 600
    for seed in range(n):
        gen = engine.generate(prompt, torch.Generator().manual_seed(seed))
        x1, x2 = gen.token_ids
        counts[x1, x2] += 1
        accepted += sum(r.accepted > 0 for r in gen.rounds)
        rejected += sum(r.accepted == 0 for r in gen.rounds)
    assert accepted > 50 and rejected > 50  # both paths of the rule really ran
    stat, df = chi_square(counts, joint)
    assert stat < chi_square_critical(df), (stat, df)
