"""EVICT's calibrated acceptance (vat/eval/calibration.py): the counts recover a synthetic draft's known acceptance per
depth and confidence bin, shrink empty bins to their depth's rate, change EVICT's cut the way the known rates say,
and a real calibration pass records exactly the nodes the verification accepted."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import olmoe_with_eagle3_drafts
from tiny_models import cached_greedy_reference

from vat.eval.calibration import AcceptanceCalibration, CalibrationRecorder
from vat.eval.cost import CostModel, draft_shape, get_accelerator, target_shape
from vat.eval.engine import SpeculativeEngine
from vat.eval.evict import Evict, chain_probs, evict_select, tree_probs
from vat.eval.tree import TreeSpec
from vat.eval.verify_cost import build_verify_cost, own_texts

NEW_TOKENS = 24


def synthetic_rounds(n: int, seed: int = 0):
    """Chains of 4 drafts whose raw estimate (a path probability) understates acceptance: each position i (depth
    i + 1) reports raw q^(i+1) with q drawn from {0.3, 0.6}, and is accepted, given its parent, with probability
    0.9 when q = 0.6 and 0.5 when q = 0.3, so the true chance that node i is accepted is c^(i+1), c = 0.9 or 0.5."""
    rng = random.Random(seed)
    for _ in range(n):
        q = rng.choice((0.3, 0.6))
        c = 0.9 if q == 0.6 else 0.5
        raw = [q ** (i + 1) for i in range(4)]
        accepted = 0
        while accepted < 4 and rng.random() < c:
            accepted += 1
        yield [1, 2, 3, 4], raw, list(range(accepted)), c


def test_calibration_recovers_a_known_acceptance_per_depth_and_bin():
    cal = AcceptanceCalibration()
    for depths, raw, accepted, _ in synthetic_rounds(20_000):
        cal.record(depths, raw, accepted)
    assert cal.nodes == 80_000
    for c, q in ((0.9, 0.6), (0.5, 0.3)):
        for d in range(1, 5):
            got, want = cal.rate(d, q**d), c**d
            assert got == pytest.approx(want, abs=0.02), (c, d, got, want)
    # the raw estimates were far off: 0.6^3 = 0.22 for a node accepted 73 % of the time
    assert cal.rate(3, 0.6**3) > 3 * 0.6**3
    # round trip through eval.json
    again = AcceptanceCalibration.from_dict(cal.to_dict())
    assert again.rate(2, 0.36) == cal.rate(2, 0.36) and again.nodes == cal.nodes


def test_empty_bins_fall_back_to_their_depth_then_the_raw_estimate():
    cal = AcceptanceCalibration()
    assert cal.rate(2, 0.37) == 0.37  # nothing recorded: the raw estimate as it is
    cal.record([1, 2], [0.9, 0.5], [0])  # node 0 accepted, node 1 rejected
    cal.record([1, 2], [0.9, 0.5], [0, 1])
    overall = 3 / 4
    depth2 = (1 + cal.prior * overall) / (2 + cal.prior)
    assert cal.rate(2, 0.5) == pytest.approx((1 + cal.prior * depth2) / (2 + cal.prior))
    assert cal.rate(2, 0.001) == pytest.approx(depth2)  # an empty bin: the depth's shrunk rate
    assert cal.rate(7, 0.5) == cal.rate(2, 0.5)  # past the deepest observed depth: the deepest
    assert cal.bin(1.0) == len(cal.edges) - 2 and cal.bin(-1.0) == 0


def test_calibrated_estimates_make_evict_keep_what_the_known_rates_justify():
    """C_verify(n) = 1 + 0.35 n: with the raw path probabilities (0.6, 0.36, 0.22, 0.13) the expected tokens per cost
    peak at one draft (1.19, then 1.15); calibrated towards the true 0.9^d they climb to all four (1.41, 1.59, 1.68,
    1.71)."""
    cal = AcceptanceCalibration()
    for depths, raw, accepted, _ in synthetic_rounds(20_000, seed=1):
        cal.record(depths, raw, accepted)
    raw = [0.6 ** (i + 1) for i in range(4)]
    parents, depths = [-1, 0, 1, 2], [1, 2, 3, 4]

    def verify(n: int) -> float:
        return 1.0 + 0.35 * n

    assert evict_select(raw, parents, depths, verify, 0.0) == [0]
    assert evict_select(cal.calibrate(depths, raw), parents, depths, verify, 0.0) == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    model, target, drafts, prompts = olmoe_with_eagle3_drafts(torch.Generator().manual_seed(1234))
    model_cost = CostModel(get_accelerator("h200"), target_shape(target))
    table = build_verify_cost(target, own_texts(target, prompts, NEW_TOKENS), [1, 2, 4, 8, 16], cost=model_cost)
    yield model, target, drafts, prompts, model_cost, table
    target.close()


@pytest.mark.parametrize("tree", [None, TreeSpec(3, 4, 12)], ids=["chain", "tree"])
def test_a_calibration_pass_counts_every_drafted_node_and_exactly_the_accepted_ones(setup, tree):
    model, target, drafts, prompts, model_cost, table = setup
    draft = drafts["rigged"]  # proposes tokens the target often accepts
    cal = AcceptanceCalibration()
    recorder = CalibrationRecorder(cal, tree_probs, chain_probs)
    engine = SpeculativeEngine(target, draft, steps=5, tree=tree, policies=[recorder], max_new_tokens=NEW_TOKENS)
    drafted = accepted = 0
    for prompt in prompts:
        gen = engine.generate(prompt)
        assert gen.token_ids == cached_greedy_reference(model, prompt, NEW_TOKENS)  # the pass cuts nothing
        drafted += sum(r.drafted for r in gen.rounds)
        accepted += sum(r.accepted for r in gen.rounds)
    assert cal.nodes == drafted and sum(map(sum, cal.accepted)) == accepted > 0
    # a calibrated EVICT stays lossless
    evict = Evict(model_cost, table, draft_shape(draft), calibration=cal)
    for prompt in prompts:
        engine = SpeculativeEngine(target, draft, steps=5, tree=tree, policies=[evict], max_new_tokens=NEW_TOKENS)
        assert engine.generate(prompt).token_ids == cached_greedy_reference(model, prompt, NEW_TOKENS)
