"""How bench.md writes an estimate and a ratio cell (shared by the summary's tables and the offload section)."""

from __future__ import annotations


def fmt_estimate(est: dict | None, digits: int = 3) -> str:
    """``value [low, high]`` of an estimate dict, or "–" without one."""
    if not est or est.get("value") is None:
        return "–"
    return f"{est['value']:.{digits}f} [{est['low']:.{digits}f}, {est['high']:.{digits}f}]"


FALLBACK_MARK = " †"  # a budgeted row's ratio to a method that was not evaluated at that budget (its natural τ)


def ratio_cell(est: dict | None, budget: str) -> str:
    """A ratio cell: the bootstrap estimate, the seed-level t interval and the per-seed values where there are
    several seeds, **win** when both lower bounds exceed 1; marked † when its denominator is at natural routing
    while the row is under ``budget``."""
    text = fmt_estimate(est)
    if est and est.get("t"):
        text += f" t [{est['t']['low']:.3f}, {est['t']['high']:.3f}]"
    if est and len(est.get("per_seed") or {}) > 1:
        text += " (" + " / ".join(f"{v:.2f}" for v in est["per_seed"].values()) + ")"
    if est and est.get("win"):
        text += " **win**"
    return text + (FALLBACK_MARK if est and est.get("reference_budget") not in (None, budget) else "")
