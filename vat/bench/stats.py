"""Acceptance length with bootstrap intervals: pure functions of per-prompt counts (no model, no I/O).

τ is a ratio of sums, Σ committed / Σ rounds, pooled over every prompt of every seed (never a mean of per-prompt τ:
long answers weigh what their rounds weigh). Its uncertainty has two sources, the prompts sampled from the benchmark
and the training seed, so each bootstrap replicate resamples both: seeds with replacement and prompts with
replacement, crossed (every drawn seed is read on the same drawn prompts, because every seed is evaluated on the
same prompts). A replicate is a pair of count vectors, and its τ is ``w_s · C · w_p / w_s · R · w_p``.

A ratio between two methods is **paired**: one replicate draws seed and prompt indices once and applies them to
both, since seed i of every method trained on the same data order and prompt j is the same question. A training-free
baseline has no seeds: it pairs over prompts only while the other side's seeds are still resampled.

With few seeds the crossed bootstrap understates how much training seeds disagree (a seed is resampled, not
imagined), so every ratio also gets its per-seed values and a seed-level Student-t interval over them
(:func:`t_interval`); a ratio is a win only when both lower bounds exceed 1 (:func:`is_win`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Estimate:
    """A point estimate with a percentile-bootstrap interval.

    Attributes:
        value: the statistic on the full sample.
        low: lower interval bound.
        high: upper interval bound.
    """

    value: float
    low: float
    high: float

    def to_dict(self) -> dict:
        return asdict(self)


def pooled_tau(committed: np.ndarray, rounds: np.ndarray) -> float:
    """Σ committed / Σ rounds over every entry (NaN when there is no round).

    Args:
        committed: (S, P) or any shape: tokens committed per prompt (and seed).
        rounds: same shape: verification rounds (target forwards) per prompt.
    """
    den = float(np.sum(rounds))
    return float(np.sum(committed)) / den if den > 0 else float("nan")


def per_seed_tau(committed: np.ndarray, rounds: np.ndarray) -> list[float]:
    """τ of each seed (row), pooled over its prompts.

    Args:
        committed: (S, P).
        rounds: (S, P).

    Returns:
        S values.
    """
    return [pooled_tau(c, r) for c, r in zip(np.asarray(committed), np.asarray(rounds))]


def resample_counts(n: int, samples: int, rng: np.random.Generator) -> np.ndarray:
    """How often each of ``n`` items is drawn in each of ``samples`` draws of ``n`` with replacement.

    Returns:
        (samples, n) integer counts; every row sums to n.
    """
    return rng.multinomial(n, np.full(n, 1.0 / n), size=samples)


def replicate_taus(committed: np.ndarray, rounds: np.ndarray, seed_w: np.ndarray, prompt_w: np.ndarray) -> np.ndarray:
    """τ of each bootstrap replicate: Σ_s Σ_p w_s w_p c[s, p] / Σ_s Σ_p w_s w_p r[s, p].

    Args:
        committed: (S, P).
        rounds: (S, P).
        seed_w: (B, S) seed counts of each replicate.
        prompt_w: (B, P) prompt counts.

    Returns:
        (B,) τ per replicate (NaN where a replicate drew no round).
    """
    c = np.asarray(committed, dtype=np.float64)
    r = np.asarray(rounds, dtype=np.float64)
    num = np.einsum("bs,sp,bp->b", seed_w, c, prompt_w)  # (B,)
    den = np.einsum("bs,sp,bp->b", seed_w, r, prompt_w)  # (B,)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _interval(replicates: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    finite = replicates[np.isfinite(replicates)]
    if finite.size == 0:
        return float("nan"), float("nan")
    low, high = np.quantile(finite, [alpha, 1.0 - alpha])
    return float(low), float(high)


def _check(committed: np.ndarray, rounds: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    c = np.atleast_2d(np.asarray(committed, dtype=np.float64))
    r = np.atleast_2d(np.asarray(rounds, dtype=np.float64))
    if c.shape != r.shape or c.ndim != 2 or c.size == 0:
        raise ValueError(f"{what}: committed {c.shape} and rounds {r.shape} must be the same non-empty (seeds, prompts)")
    return c, r


def bootstrap_tau(committed: np.ndarray, rounds: np.ndarray, *, samples: int = 2000, seed: int = 0,
                  confidence: float = 0.95) -> Estimate:
    """Pooled τ with a percentile-bootstrap interval resampling seeds and prompts (crossed).

    Args:
        committed: (S, P) tokens committed per seed and prompt; a training-free method has S = 1.
        rounds: (S, P) verification rounds.
        samples: bootstrap replicates B.
        seed: seeds the resampling.
        confidence: interval coverage (0.95 = 2.5th to 97.5th percentile).
    """
    c, r = _check(committed, rounds, "bootstrap_tau")
    rng = np.random.default_rng(seed)
    seed_w = resample_counts(c.shape[0], samples, rng)  # (B, S)
    prompt_w = resample_counts(c.shape[1], samples, rng)  # (B, P)
    low, high = _interval(replicate_taus(c, r, seed_w, prompt_w), confidence)
    return Estimate(pooled_tau(c, r), low, high)


def paired_ratio(committed: np.ndarray, rounds: np.ndarray, ref_committed: np.ndarray, ref_rounds: np.ndarray, *,
                 samples: int = 2000, seed: int = 0, confidence: float = 0.95) -> Estimate:
    """τ_method / τ_reference with a paired bootstrap interval.

    Each replicate draws one set of prompt counts for both sides. Seeds: when both sides have S rows, row i of each
    is the same seed and the same seed counts apply to both; a side with one row (a training-free baseline, or a
    single-seed bench) is read on the drawn prompts only while the other side's seeds are resampled.

    Args:
        committed: (S, P) or (1, P) of the method.
        rounds: same shape.
        ref_committed: (S, P) or (1, P) of the reference; prompt j is the same prompt on both sides.
        ref_rounds: same shape.
        samples: bootstrap replicates B.
        seed: seeds the resampling.
        confidence: interval coverage.

    Raises:
        ValueError: the prompt counts differ, or both sides have several seeds but not the same number.
    """
    c, r = _check(committed, rounds, "paired_ratio (method)")
    rc, rr = _check(ref_committed, ref_rounds, "paired_ratio (reference)")
    if c.shape[1] != rc.shape[1]:
        raise ValueError(f"paired_ratio: {c.shape[1]} prompts vs {rc.shape[1]} for the reference; they must pair")
    n_seeds = max(c.shape[0], rc.shape[0])
    if c.shape[0] not in (1, n_seeds) or rc.shape[0] not in (1, n_seeds):
        raise ValueError(f"paired_ratio: {c.shape[0]} vs {rc.shape[0]} seeds; pair them by seed first")
    rng = np.random.default_rng(seed)
    seed_w = resample_counts(n_seeds, samples, rng)  # (B, S) shared by both sides
    prompt_w = resample_counts(c.shape[1], samples, rng)  # (B, P) shared by both sides
    single = np.ones((samples, 1))  # a one-row side: every replicate reads its only row
    tau_m = replicate_taus(c, r, seed_w if c.shape[0] == n_seeds else single, prompt_w)
    tau_r = replicate_taus(rc, rr, seed_w if rc.shape[0] == n_seeds else single, prompt_w)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = tau_m / tau_r
    low, high = _interval(ratios, confidence)
    return Estimate(pooled_tau(c, r) / pooled_tau(rc, rr), low, high)


# ---- the seed-level view ---------------------------------------------------------------------------------------------


def per_seed_ratios(committed: np.ndarray, rounds: np.ndarray, ref_committed: np.ndarray,
                    ref_rounds: np.ndarray) -> list[float]:
    """τ_method / τ_reference seed by seed (row i against row i; a one-row side is read against every row).

    Args:
        committed, rounds: (S, P) or (1, P) of the method.
        ref_committed, ref_rounds: (S, P) or (1, P) of the reference.

    Returns:
        max(S_method, S_reference) ratios, in row order.
    """
    c, r = _check(committed, rounds, "per_seed_ratios (method)")
    rc, rr = _check(ref_committed, ref_rounds, "per_seed_ratios (reference)")
    n = max(c.shape[0], rc.shape[0])
    if c.shape[0] not in (1, n) or rc.shape[0] not in (1, n):
        raise ValueError(f"per_seed_ratios: {c.shape[0]} vs {rc.shape[0]} seeds; pair them by seed first")
    pick = lambda a, i: a[0] if a.shape[0] == 1 else a[i]  # noqa: E731
    return [pooled_tau(pick(c, i), pick(r, i)) / pooled_tau(pick(rc, i), pick(rr, i)) for i in range(n)]


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (regularised incomplete beta, no SciPy)."""
    x = df / (df + t * t)
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, x)  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on :func:`student_t_cdf`; |error| < 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"student_t_quantile: p must lie in (0, 1), got {p}")
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-11:
            break
    return 0.5 * (lo + hi)


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function (continued fraction, Lentz's method)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only: use the symmetry
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = tiny if abs(d) < tiny else d
        d = 1.0 / d
        c = 1.0 + num / c
        c = tiny if abs(c) < tiny else c
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return math.exp(log_front) * (f - 1.0) / a


def t_interval(values: list[float], confidence: float = 0.95) -> Estimate | None:
    """Mean of ``values`` with a Student-t interval, mean ± t_{S-1} · sd / √S (None for fewer than 2 values).

    Over per-seed ratios this is the seed-level interval: it sees only how the S training seeds disagree, where the
    crossed bootstrap also resamples prompts and, with few seeds, understates the seed spread.
    """
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=np.float64)
    if v.size < 2:
        return None
    mean, sd = float(v.mean()), float(v.std(ddof=1))
    half = student_t_quantile(0.5 + confidence / 2.0, v.size - 1) * sd / math.sqrt(v.size)
    return Estimate(mean, mean - half, mean + half)


def is_win(bootstrap: dict | Estimate, t: dict | Estimate | None) -> bool:
    """A ratio is a win only when both the bootstrap and the seed-level t interval lie above 1 (no t interval, as
    with one seed, is no win)."""
    low = lambda e: e.low if isinstance(e, Estimate) else e["low"]  # noqa: E731
    return t is not None and low(bootstrap) > 1.0 and low(t) > 1.0


def ratio_record(side: tuple[np.ndarray, np.ndarray], ref: tuple[np.ndarray, np.ndarray], seeds: list,
                 kw: dict) -> dict:
    """One ratio as bench.json keeps it: the paired bootstrap estimate, the per-seed ratios, the seed-level t
    interval over them (None with one seed) and ``win`` (both lower bounds above 1)."""
    boot = paired_ratio(*side, *ref, **kw)
    values = per_seed_ratios(*side, *ref)
    t = t_interval(values, kw.get("confidence", 0.95))
    labels = [str(s) for s in seeds] if len(seeds) == len(values) else [str(i) for i in range(len(values))]
    return {**boot.to_dict(), "seeds": seeds, "per_seed": dict(zip(labels, values)),
            "t": None if t is None else t.to_dict(), "win": is_win(boot, t)}
