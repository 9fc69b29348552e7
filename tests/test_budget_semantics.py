"""Expert-budget semantics on the real tiny transformers models, against per-token Python references
(``reference_budget`` in helpers.py): DeepSeek-V3's group limit under a budget, truncation's coverage fallback,
B < k, B between k and the natural union, and the dropped-slot path of every experts implementation."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_budget, router_io
from tiny_models import FAMILIES, randomized_routing, tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from vat.errors import VatError
from vat.target import BudgetSpec, load_target, window_union
from vat.target.model import EXPERT_PARALLEL_FLAG
from vat.target.routing import fill_dropped_slots

SEQ = 12


def _deepseek(n_group: int, topk_group: int, seed: int = 0, **kwargs):
    """A tiny DeepSeek-V3 with another group layout (randomised as tiny_models.tiny_model does)."""
    torch.manual_seed(seed)
    config = tiny_config("deepseek_v3", **kwargs)
    config.n_group, config.topk_group = n_group, topk_group
    return randomized_routing(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def _budgeted_io(target, ids, spec):
    """One budgeted forward; per MoE layer the router's natural output on the same input and what the experts got."""
    records, handles = router_io(target)
    out = target.forward(ids, budget=spec)
    for h in handles:
        h.remove()
    layers = []
    for ordinal, (_, router, _) in enumerate(target.routing.moe_layers):
        natural = router(records[ordinal]["input"])  # (logits, weights, ids) outside any vat context
        layers.append((router, natural, records[ordinal]["output"]))
    return out, layers


def _assert_matches_reference(family, target, out, layers, spec):
    """Every token's executed experts and weights equal the per-token reference; returns the reference routes."""
    groups = out.window_groups.reshape(-1).tolist()
    routes = []
    for ordinal, (router, (logits, nat_w, nat_ids), (_, got_w, got_ids)) in enumerate(layers):
        want_all = reference_budget(family, router, logits, nat_w, nat_ids, groups, spec.B, spec.policy, spec.rank)
        for t, want in enumerate(want_all):
            got = {e: w for e, w in zip(got_ids[t].tolist(), got_w[t].tolist()) if e != target.num_experts}
            assert set(got) == set(want), (family, spec.policy, ordinal, t, got, want)
            for e in want:
                assert got[e] == pytest.approx(want[e], rel=1e-5, abs=1e-6), (family, spec.policy, ordinal, t)
        routes.append(want_all)
    return routes


# ---- DeepSeek-V3: the group limit never leaves a slot empty while S has an expert for it -----------------------

def test_deepseek_b3_fills_every_slot_across_groups():
    """Groups of 2 experts, one group per token: a budget set of 3 spans >= 2 groups, so every group holds at most
    2 of it and a 1-expert group used to sink (-1e4) — half the slots empty. Now all k = 2 slots are filled."""
    target = load_target(_deepseek(n_group=4, topk_group=1), device="cpu")
    ids = torch.randint(3, 128, (2, SEQ))
    spec = BudgetSpec(B=3, window=4)
    out, layers = _budgeted_io(target, ids, spec)
    budgeted = out.window_groups.reshape(-1) >= 0
    filled = (out.topk_ids != target.num_experts).sum(-1).reshape(len(layers), -1)  # (L', N)
    assert (filled[:, budgeted] == target.top_k).all(), filled  # |S| = 3 >= k: k slots, always
    unions = window_union(out.topk_ids, out.window_groups, out.n_windows, target.num_experts)
    assert int(unions.max()) == 3 and int(unions.min()) >= target.top_k
    _assert_matches_reference("deepseek_v3", target, out, layers, spec)


@pytest.mark.parametrize("budget", [2, 3, 4])
@pytest.mark.parametrize("policy", ["substitute", "truncate", "truncate_cover"])
def test_deepseek_default_groups_match_reference(budget, policy):
    target = load_target(tiny_model("deepseek_v3"), device="cpu")
    ids = torch.randint(3, 128, (2, SEQ))
    spec = BudgetSpec(B=budget, window=4, policy=policy)
    out, layers = _budgeted_io(target, ids, spec)
    _assert_matches_reference("deepseek_v3", target, out, layers, spec)
    if policy == "substitute" and budget >= target.top_k:
        assert (out.topk_ids != target.num_experts).all()


@pytest.mark.parametrize("policy", ["substitute", "truncate"])
def test_deepseek_budget_ranked_by_its_routing_scores_matches_reference(policy):
    """``rank="routing"`` (an extension): DeepSeek-V3's budget set summed over the scores its tokens rank by (sigmoid +
    correction bias) against the brute-force reference; with a strong bias it picks other sets than the paper's
    ranking by the unbiased scores, and for a softmax family the two ranks are the same forward."""
    model = tiny_model("deepseek_v3")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 1.5, generator=torch.Generator().manual_seed(4))  # big enough to reorder sets
    target = load_target(model, device="cpu")
    ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(5))
    routing = BudgetSpec(B=3, window=4, policy=policy, rank="routing")
    out, layers = _budgeted_io(target, ids, routing)
    _assert_matches_reference("deepseek_v3", target, out, layers, routing)
    plain = target.forward(ids, budget=BudgetSpec(B=3, window=4, policy=policy))
    assert not torch.equal(out.topk_ids, plain.topk_ids)  # the bias really changes the sets
    target.close()
    olmoe = load_target(tiny_model("olmoe"), device="cpu")
    a = olmoe.forward(ids, budget=BudgetSpec(B=3, window=4, policy=policy))
    b = olmoe.forward(ids, budget=BudgetSpec(B=3, window=4, policy=policy, rank="routing"))
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.logits, b.logits)
    olmoe.close()
    with pytest.raises(VatError, match="unknown budget rank `biased`: one of weights, routing"):
        BudgetSpec(B=3, rank="biased")


def test_deepseek_unbudgeted_selection_is_the_models_own():
    """The adapter's rule with every expert allowed reproduces the router exactly (widening never triggers)."""
    from vat.target import adapter_for

    model = _deepseek(n_group=4, topk_group=2, num_experts=16, top_k=4)
    router = model.model.layers[0].mlp.gate
    x = torch.randn(40, model.config.hidden_size)
    logits, weights, ids = router(x)
    got_w, got_ids = adapter_for(model.config).select(router, logits, torch.ones_like(logits, dtype=torch.bool))
    assert torch.equal(got_ids.sort(-1).values, ids.sort(-1).values)
    order_got, order_own = got_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(got_w.gather(1, order_got), weights.gather(1, order_own))


# ---- truncation ------------------------------------------------------------------------------------------------

def test_plain_truncate_gives_out_of_set_experts_zero_weight_on_a_hand_built_router():
    """MoE-Spec's truncation: one window of three tokens, B = 2. S = the two experts with the largest summed score
    ({0, 1}); a token inside S keeps its weights bit for bit, a token half inside keeps its in-set weight unrescaled
    and loses the other slot, a token with no expert in S gets no expert output; truncate_cover rescales the half
    token to its natural total and substitutes the uncovered one."""
    from vat.target import adapter_for
    from vat.target.budget import apply_budget

    model = tiny_model("olmoe", num_experts=8, top_k=2)
    router = model.model.layers[0].mlp.gate
    adapter = adapter_for(model.config)
    logits = torch.full((3, 8), -4.0)
    logits[0, 0], logits[0, 1] = 6.0, 5.0  # token 0 routes to {0, 1}
    logits[1, 1], logits[1, 5] = 5.5, 5.0  # token 1 to {1, 5}
    logits[2, 6], logits[2, 7] = 1.0, 0.5  # token 2 to {6, 7}: small scores, outside S
    weights = torch.tensor([[0.6, 0.3], [0.5, 0.4], [0.7, 0.2]])
    ids = torch.tensor([[0, 1], [1, 5], [6, 7]])
    groups = torch.zeros(3, dtype=torch.long)
    counts = {}
    got_w, got_ids = apply_budget(adapter, router, logits, (weights, ids), groups, 1, 2, "truncate", counts)
    E = 8
    assert got_ids.tolist() == [[0, 1], [1, E], [E, E]]
    assert torch.equal(got_w, torch.tensor([[0.6, 0.3], [0.5, 0.0], [0.0, 0.0]]))  # nothing rescaled
    assert int(counts["uncovered"]) == 1
    cover_w, cover_ids = apply_budget(adapter, router, logits, (weights, ids), groups, 1, 2, "truncate_cover")
    assert cover_ids[1].tolist() == [1, E] and cover_w[1, 0].item() == pytest.approx(0.9)  # rescaled to the total
    assert set(cover_ids[2].tolist()) <= {0, 1} and (cover_ids[2] != E).any()  # substituted inside S


@pytest.mark.parametrize("family", FAMILIES)
def test_truncate_cover_never_leaves_a_token_without_experts(family):
    target = load_target(tiny_model(family), device="cpu")
    ids = torch.randint(3, 128, (2, SEQ))
    spec = BudgetSpec(B=2, window=4, policy="truncate_cover")
    out, layers = _budgeted_io(target, ids, spec)
    budgeted = out.window_groups.reshape(-1) >= 0
    empty = (out.topk_ids == target.num_experts).all(-1).reshape(len(layers), -1)  # (L', N)
    assert not empty[:, budgeted].any(), f"{family}: {int(empty.sum())} tokens with zero expert output"
    _assert_matches_reference(family, target, out, layers, spec)
    # the count: tokens none of whose natural experts is in the executed window union (= S, under truncation)
    groups = out.window_groups.reshape(-1)
    want = []
    for _router, (_, _, nat_ids), (_, _, got_ids) in layers:
        used = {}
        for t, g in enumerate(groups.tolist()):
            used.setdefault(g, set()).update(e for e in got_ids[t].tolist() if e != target.num_experts)
        want.append(sum(not set(nat_ids[t].tolist()) & used[g] for t, g in enumerate(groups.tolist())))
    assert out.n_uncovered.tolist() == want
    assert sum(want) > 0  # the case is really exercised


# ---- B < k and k < B < natural union -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["substitute", "truncate", "truncate_cover"])
@pytest.mark.parametrize("budget", [1, 3])
def test_budget_below_top_k(family, policy, budget):
    """top_k = 4 of 8 experts, B < k: at most B distinct experts per window, S's B experts fill B slots under
    substitution, and each token matches the reference."""
    target = load_target(tiny_model(family, top_k=4), device="cpu")
    ids = torch.randint(3, 128, (2, SEQ))
    spec = BudgetSpec(B=budget, window=4, policy=policy)
    out, layers = _budgeted_io(target, ids, spec)
    unions = window_union(out.topk_ids, out.window_groups, out.n_windows, target.num_experts)
    assert int(unions.max()) <= budget
    filled = (out.topk_ids != target.num_experts).sum(-1)  # (L', B, T)
    if policy != "truncate":  # MoE-Spec's truncation leaves a token with no expert in S without expert output
        assert int(filled.min()) >= 1
    if policy == "substitute":
        assert (filled == budget).all()
    _assert_matches_reference(family, target, out, layers, spec)


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_between_top_k_and_union_mixes_fitting_and_cut_windows(family):
    """k < B < the largest natural union: windows whose union fits keep their natural routing bit for bit (the
    fits-in-budget path, not B = E's early exit), the others are cut to B, all as the reference says. "Natural" is
    the router's own output on the budgeted forward's input (past layer 0, cut windows change every later input)."""
    target = load_target(tiny_model(family), device="cpu")
    ids = torch.randint(3, 128, (3, SEQ))
    budget = 4
    assert target.top_k < budget < target.num_experts
    spec = BudgetSpec(B=budget, window=4)
    out, layers = _budgeted_io(target, ids, spec)
    token_window = out.window_groups.reshape(-1)  # (N,)
    nat_ids = torch.stack([natural[2] for _, natural, _ in layers])  # (L', N, k) on the same inputs
    nat_unions = window_union(nat_ids[:, None], out.window_groups.reshape(1, -1), out.n_windows, target.num_experts)
    fits = nat_unions <= budget  # (L', G)
    assert fits.any() and (~fits).any(), nat_unions  # both paths exercised
    unions = window_union(out.topk_ids, out.window_groups, out.n_windows, target.num_experts)
    assert torch.equal(unions[fits], nat_unions[fits]) and bool((unions <= budget).all())
    got = out.topk_ids.reshape(len(layers), -1, target.top_k)  # (L', N, k)
    for layer in range(len(layers)):
        keep = fits[layer][token_window]  # (N,) tokens of fitting windows
        assert torch.equal(got[layer][keep], nat_ids[layer][keep])
    _assert_matches_reference(family, target, out, layers, spec)


# ---- the dropped-slot path of each experts implementation -------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_transformers_expert_parallel_flag_skips_dropped_slots(family, impl):
    """vat relies on transformers' private ``_is_expert_parallel`` to make grouped_mm/batched_mm skip the sentinel.
    Fails when the installed transformers renames it or stops honouring it."""
    model = tiny_model(family)
    experts = model.model.layers[0].mlp.experts
    assert getattr(experts, EXPERT_PARALLEL_FLAG) is False  # exists, off by default
    target = load_target(model, device="cpu", experts_impl=impl)
    assert getattr(experts, EXPERT_PARALLEL_FLAG) is True
    E, k = experts.num_experts, target.top_k
    x = torch.randn(6, model.config.hidden_size)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(6)])  # (6, k)
    w = torch.rand(6, k)
    ids[1, 0] = ids[3, 1] = E  # dropped slots (weight 0, as vat's budget leaves them)
    w[1, 0] = w[3, 1] = 0.0
    got = experts(x, ids, w)
    model.set_experts_implementation("eager")
    want = experts(x, fill_dropped_slots(ids, E), w)  # eager, sentinel replaced by a kept expert at weight 0
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_missing_expert_parallel_flag_is_refused_in_one_line():
    model = tiny_model("olmoe")
    for layer in model.model.layers:
        del layer.mlp.experts._is_expert_parallel  # what a transformers without the flag looks like
    with pytest.raises(VatError, match="budget-dropped slots would not be skipped"):
        load_target(model, device="cpu", experts_impl="grouped_mm")


@pytest.mark.parametrize("policy,budget", [("truncate", 2), ("truncate_cover", 2), ("substitute", 1)])
def test_gpt_oss_eager_runs_eager_under_a_budget(policy, budget):
    """GPT-OSS's eager experts have no one-hot class for the sentinel: vat fills dropped slots with a kept expert at
    weight 0 rather than swapping eager for grouped_mm. Same logits as grouped_mm; without the fill eager raises,
    which also proves it is eager that ran."""
    ids = torch.randint(3, 128, (2, SEQ))
    spec = BudgetSpec(B=budget, window=4, policy=policy)
    eager = load_target(tiny_model("gpt_oss"), device="cpu", experts_impl="eager")
    grouped = load_target(tiny_model("gpt_oss"), device="cpu", experts_impl="grouped_mm")
    assert eager.experts_impl == "eager"
    a, b = eager.forward(ids, budget=spec), grouped.forward(ids, budget=spec)
    assert (a.topk_ids == eager.num_experts).any()  # dropped slots really reached the experts
    assert torch.equal(a.topk_ids, b.topk_ids)
    assert torch.allclose(a.logits, b.logits, atol=1e-5)
    eager.routing.fill_dropped_slots = False
    with pytest.raises((RuntimeError, IndexError)):
        eager.forward(ids, budget=spec)


def test_budget_rank_reaches_every_budgeted_pass_and_its_kl_forward():
    """`vat eval --budget-rank routing` picks the registry's rank policy: its hook ranks every budgeted pass's set (and
    the KL forward's, through the same hooks) by the routing scores; natural passes get no hook; a bad value is one
    line."""
    from vat.eval.config import check_eval_config, eval_config
    from vat.eval.run import DraftEntry, RunConfig, _kl_key, _kl_spec

    checked = check_eval_config(eval_config(budget_rank="routing", budgets="none,4"))
    (rank,) = [p for p in checked.policies if p.setting == "budget_rank"]
    draft = DraftEntry("d", None, model=object())
    assert rank.for_pass(draft, None) is None
    assert rank.for_pass(draft, 4).budget_spec(BudgetSpec(B=4)).rank == "routing"
    spec = _kl_spec(RunConfig(draft, 4), 8, "substitute", checked.policies)
    assert (spec.rank, spec.B, spec.window) == ("routing", 4, 8)
    assert _kl_key(RunConfig(draft, 4), 8, checked.policies) != _kl_key(RunConfig(draft, 4), 8, [])
    assert not [p for p in check_eval_config(eval_config()).policies if p.setting == "budget_rank"]
    with pytest.raises(VatError, match=r"--budget-rank `biased`: one of weights, routing"):
        check_eval_config(eval_config(budget_rank="biased"))
