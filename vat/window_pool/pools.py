"""The Window Pool constraint of one training step and the pool-mass term.

A constrained step tiles every sequence into windows of W positions from a random offset; at each constrained MoE
layer the tokens of a window may route only inside the window's pool of d_w experts. The pool is exactly the MoE-Spec
budget set (:func:`vat.target.budget.budget_sets`: the window's natural union when it fits in d_w, else the top-d_w
experts by summed router probability) and tokens are rerouted by substitution (:func:`vat.target.budget.apply_budget`),
so the kept experts' weights are the router's own probabilities and the LM loss reaches the router through them.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from vat.config import DEFAULT_BUDGET_POLICY
from vat.errors import VatError
from vat.target.budget import BudgetSpec


def check_ranges(wp: Any, num_experts: int, moe_layer_ids: list[int]) -> None:
    """One clear line for a W / d_w range or a layer list the target cannot take."""
    for key, values, low in (("windows", wp.windows, 1), ("pools", wp.pools, 1)):
        if values is None and key == "windows":
            continue  # one pool per row
        if values is None or len(values) != 2 or int(values[0]) > int(values[1]) or int(values[0]) < low:
            raise VatError(f"config key `window_pool.{key}` must be [lo, hi] with {low} <= lo <= hi, got {list(values)}")
    if int(wp.pools[1]) > num_experts:
        raise VatError(f"config key `window_pool.pools` {list(wp.pools)}: d_w cannot exceed the target's "
                       f"{num_experts} experts")
    if not 0.0 <= float(wp.unconstrained_frac) <= 1.0:
        raise VatError(f"config key `window_pool.unconstrained_frac` must be in [0, 1], got {wp.unconstrained_frac}")
    if wp.layers is not None:
        bad = [layer for layer in wp.layers if layer not in moe_layer_ids]
        if bad or not wp.layers:
            raise VatError(f"config key `window_pool.layers` {list(wp.layers)}: not MoE layers of the target "
                           f"(its MoE layers: {moe_layer_ids})")


def draw_constraint(wp: Any, seed: int, step: int) -> BudgetSpec | None:
    """The step's constraint, drawn from a generator seeded by (seed, step) so a resumed run draws the same.

    Args:
        wp: ``cfg.window_pool`` (``windows``, ``pools``, ``layers``, ``unconstrained_frac``).
        seed: the run's seed.
        step: the optimizer step (0-based) the draw is for.

    Returns:
        None for an unconstrained step, else a substitute :class:`BudgetSpec` with ``B = d_w`` on the constrained
        layers (a ``{layer: d_w}`` mapping when ``wp.layers`` is set), ``window = W`` and a random offset in [0, W);
        with ``wp.windows`` null, ``window = None``: every row is one window (the document-pool base).
    """
    rng = random.Random(seed * 1_000_003 + 104_729 + step)
    if rng.random() < float(wp.unconstrained_frac):
        return None
    whole_row = wp.windows is None
    window = None if whole_row else rng.randint(int(wp.windows[0]), int(wp.windows[1]))
    pool = rng.randint(int(wp.pools[0]), int(wp.pools[1]))
    budget: Any = pool if wp.layers is None else {int(layer): pool for layer in wp.layers}
    return BudgetSpec(B=budget, policy=DEFAULT_BUDGET_POLICY, window=window,
                      offset=0 if whole_row else rng.randrange(window), scope="sequence")


def pool_mass(pools: dict[int, tuple[torch.Tensor, torch.Tensor]], member: torch.Tensor,
              top_k: int) -> dict[str, torch.Tensor]:
    """Router probability outside each token's pool, and how often the natural top-k already lies inside it.

    Args:
        pools: MoE ordinal -> ``(router logits (N, E), allowed (N, E) bool)`` of the constrained layers
            (:class:`vat.target.routing.RoutingController` with ``record_pools``).
        member: (N,) bool, the tokens that were constrained (real tokens inside a window).
        top_k: the target's k.

    Returns:
        ``outside_sum``: differentiable sum over constrained token-layers of the probability mass outside the pool;
        ``inside_sum``: count of token-layers whose natural top-k lies inside the pool; ``count``: token-layers.
    """
    outside = inside = None
    count = 0
    for logits, allowed in pools.values():
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        m = member.to(probs.device)
        out = (probs * (~allowed)).sum(-1)[m].sum()  # mass the pool excludes
        top = probs.detach().topk(top_k, dim=-1).indices  # (N, k) natural ids
        ins = allowed.gather(1, top).all(dim=1)[m].sum()
        outside = out if outside is None else outside + out
        inside = ins if inside is None else inside + ins
        count += int(m.sum())
    if outside is None:
        zero = member.new_zeros((), dtype=torch.float32)
        return {"outside_sum": zero, "inside_sum": zero, "count": zero}
    return {"outside_sum": outside, "inside_sum": inside.float(), "count": torch.tensor(float(count))}
