"""The union term's scale s, so that λ means one thing on every target shape, batch size and anchor sample.

λ is the ratio of the union term's gradient to the imitation term's, on the draft logits of the whole batch
(docs/vat_losses.md, "λ is a gradient ratio"). The objective adds ``λ · s · L_union`` with a stop-gradient s, and
:class:`UnionScale` decides s:

1. **Nothing before the table is informative.** Until the online affinity table has folded routing, its rows are
   equal and the union gradient is fp32 rounding noise (its norm ~1e-9 of imitation's): any ratio measured then is
   noise over noise. s = 0 until then (a table loaded from ``vat prep affinity`` is informative from the start).
2. **Measured over a warm-up, then frozen.** Over the first ``warmup`` optimizer steps after that, the two gradient
   norms are summed (over micro-batches and ranks) and s is the ratio of the sums, read from the steps before the
   current one; after the warm-up s stays at that value. A per-step ratio
   follows the union gradient as the penalty flattens it, so the pull grows where the draft already concentrates
   (on the tiny target at λ = 1.6 a per-step s climbed 200-fold in 30 steps and every seed collapsed); a frozen s
   keeps λ the pull measured at warm-up.
3. **Corrected for the anchor sample.** The union term runs on M sampled anchors of the batch's N
   (``loss.union_max_anchors``) and averages over those M, an unbiased estimate of the all-anchor penalty. Measured on
   the sample, ``‖∇L_imit‖`` is ``√(M/N)`` of the batch's and ``‖∇L_union‖`` is ``√(N/M)`` of the all-anchor
   term's, so the raw ratio is M/N of the batch's: each step's norms are rescaled to the whole batch before they
   are summed (:func:`batch_norms`), and λ no longer shrinks as batches grow.
4. **The bound is a guard.** s never exceeds ``bound`` (``loss.union_scale_max``); :attr:`UnionScale.clamped` says
   when it binds and the trainer reports it in one log line.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

# the grad_ratio scale's guard (loss.union_scale_max): measured s where the union term works is 60-600 on the tiny
# targets; above 1e4 a union gradient is too flat to be a direction
UNION_SCALE_MAX = 1.0e4
UNION_SCALE_WARMUP = 20  # steps s is measured over once the table is informative (loss.union_scale_warmup)


def batch_norms(imitation_norm: Tensor, union_norm: Tensor, anchors: Tensor, sampled: Tensor) -> tuple[Tensor, Tensor]:
    """The two gradient norms measured on ``sampled`` of the batch's ``anchors``, rescaled to the whole batch.

    Args:
        imitation_norm: ``()`` ``‖∇_z L_imit‖`` over the sampled anchors' logits (the term averaged over all anchors).
        union_norm: ``()`` ``‖∇_z L_union‖`` of the penalty averaged over the sampled anchors.
        anchors: ``()`` N, the batch's valid anchors.
        sampled: ``()`` M, the valid anchors the union term ran on.

    Returns:
        ``(‖∇L_imit‖ · √(N/M), ‖∇L_union‖ · √(M/N))``: the norms the whole batch would give (exact when every anchor
        contributes alike; otherwise their expectation's scale).
    """
    root = (anchors.float().clamp_min(1.0) / sampled.float().clamp_min(1.0)).sqrt()
    return imitation_norm.float() * root, union_norm.float() / root


class UnionScale:
    """The stop-gradient scale s of the union term (module docstring): 0 before the affinity table is informative,
    the ratio of summed gradient norms over a warm-up of steps, then frozen, bounded by a guard.

    Each micro-batch's norms are added to the step's pending sums (:meth:`observe`); :meth:`commit`, once per
    optimizer step, sums them over the ranks and adds them to the totals s is read from. So a step's s comes from
    earlier steps only, and every rank, at any world size, uses the same s (one process with gradient accumulation
    over the same global batch included). The sums stay on the device (no host sync while the step runs);
    :meth:`state_dict` goes into the training checkpoint.

    Args:
        warmup: optimizer steps s is measured over before it freezes (>= 1).
        bound: the largest s (a guard: :meth:`clamped` says when it binds).
    """

    def __init__(self, warmup: int = UNION_SCALE_WARMUP, bound: float = UNION_SCALE_MAX) -> None:
        if warmup < 1:
            raise ValueError(f"union scale warm-up must be >= 1 step, got {warmup}")
        if not bound > 0:
            raise ValueError(f"union scale bound must be > 0, got {bound}")
        self.warmup, self.bound = int(warmup), float(bound)
        self.informative = False  # set once the affinity table has folded routing (or was loaded)
        self.measured = 0  # steps summed so far (up to warmup)
        self.totals: Tensor | None = None  # (2,) Σ batch-scaled (‖∇L_imit‖, ‖∇L_union‖) over the measured steps
        self.pending: Tensor | None = None  # (2,) the same over this step's micro-batches, on this rank

    @property
    def frozen(self) -> bool:
        """Whether the warm-up is over (s no longer changes, the norms need not be measured)."""
        return self.measured >= self.warmup

    @property
    def needs_norms(self) -> bool:
        """Whether this step's gradient norms change s (the same on every rank)."""
        return self.informative and not self.frozen

    @torch.no_grad()
    def observe(self, imitation_norm: Tensor, union_norm: Tensor) -> None:
        """Add one micro-batch's batch-scaled norms (:func:`batch_norms`) to the step's; ignored unless
        :attr:`needs_norms`."""
        if not self.needs_norms:
            return
        pair = torch.stack([imitation_norm.detach().float(), union_norm.detach().float()])
        self.pending = pair if self.pending is None else self.pending + pair

    @torch.no_grad()
    def commit(self, reduce_sum: Callable[[Tensor], Tensor] | None = None, device: torch.device | None = None) -> None:
        """End of an optimizer step: the step's sums over every rank join the totals (while warming up).

        Args:
            reduce_sum: sums a tensor over the ranks (e.g. ``accelerator.reduce(t, "sum")``); None = one process.
                Called on every rank or none (:attr:`needs_norms` is the same everywhere).
            device: where a rank that observed nothing this step puts its zeros.
        """
        if not self.needs_norms:
            self.pending = None
            return
        pair = self.pending if self.pending is not None else torch.zeros(2, device=device)
        self.pending = None
        if reduce_sum is not None:
            pair = reduce_sum(pair)
        if not bool(torch.isfinite(pair).all()) or not bool(pair[0] > 0):
            return  # a skipped (non-finite) or empty step measures nothing
        self.totals = pair if self.totals is None else self.totals + pair
        self.measured += 1

    def unbounded(self, device: torch.device | None = None) -> Tensor:
        """``()`` the ratio of the summed norms (0 before any measured step or with no union gradient)."""
        if self.totals is None:
            return torch.zeros((), device=device)
        imit, union = self.totals.unbind()
        return torch.where(union > 0, imit / union.clamp_min(1e-30), torch.zeros_like(union))

    def value(self, device: torch.device | None = None) -> Tensor:
        """``()`` s: the bounded ratio, 0 before the table is informative."""
        if not self.informative:
            return torch.zeros((), device=device)
        return self.unbounded(device).clamp_max(self.bound)

    def clamped(self, device: torch.device | None = None) -> Tensor:
        """``()`` bool: the guard binds (the ratio exceeds ``bound``)."""
        return self.unbounded(device) > self.bound

    def state_dict(self) -> dict:
        """What a resumed run needs to use the same s (taken between steps: nothing pending)."""
        return {"informative": self.informative, "measured": self.measured,
                "totals": None if self.totals is None else self.totals.detach().cpu().tolist()}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict` (the totals onto ``device``)."""
        self.informative, self.measured = bool(state["informative"]), int(state["measured"])
        totals = state["totals"]
        self.totals = None if totals is None else torch.tensor(totals, dtype=torch.float32, device=device)
        self.pending = None


def effective_lambda(lam: float, scale: Tensor, imitation_norm: Tensor, union_norm: Tensor) -> Tensor:
    """``()`` the pull the union term had this evaluation: ``λ · s · ‖∇L_union‖ / ‖∇L_imit‖`` (batch-scaled norms)."""
    if not math.isfinite(lam):
        raise ValueError(f"λ must be finite, got {lam}")
    return lam * scale * union_norm / imitation_norm.clamp_min(1e-30)
