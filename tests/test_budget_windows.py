"""Budget windows aligned with verification blocks (``BudgetSpec.phase``, the trainer's ``budget.align: response``)
against slow per-row and per-anchor references."""

from __future__ import annotations

import pytest
import torch

from vat.errors import VatError
from vat.target.budget import BudgetSpec, window_groups


def _partition(groups: torch.Tensor) -> set[frozenset]:
    """The windows of a (B, T) group map as a set of cell sets (ids do not matter)."""
    cells: dict[int, set] = {}
    for b, t in (groups >= 0).nonzero().tolist():
        cells.setdefault(int(groups[b, t]), set()).add((b, t))
    return {frozenset(c) for c in cells.values()}


def _runs(budgeted_row: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of True."""
    runs, t = [], 0
    while t < len(budgeted_row):
        if budgeted_row[t]:
            a = t
            while t < len(budgeted_row) and budgeted_row[t]:
                t += 1
            runs.append((a, t))
        else:
            t += 1
    return runs


def _reference(budgeted: torch.Tensor, window: int, phase: list[int]) -> set[frozenset]:
    """Slow: per row, per run [a, b): the leading window [a, a + φ) then windows of W from a + φ, cut at b."""
    out = set()
    for b, row in enumerate(budgeted.tolist()):
        for a, end in _runs(row):
            starts = ([a] if phase[b] > 0 else []) + list(range(a + phase[b], end, window))
            bounds = starts + [end]
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                lo, hi = max(lo, a), min(hi, end)
                if hi > lo:
                    out.add(frozenset((b, t) for t in range(lo, hi)))
    return out


def _random_mask(gen: torch.Generator, rows: int, length: int) -> torch.Tensor:
    """Rows of prompt / response / user-turn / response / padding: several budgeted runs per row."""
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows):
        t = int(torch.randint(1, 6, (1,), generator=gen))
        while t < length:
            run = int(torch.randint(1, 14, (1,), generator=gen))
            mask[b, t:t + run] = True
            t += run + int(torch.randint(1, 5, (1,), generator=gen))
        mask[b, length - int(torch.randint(0, 4, (1,), generator=gen)):] = False  # padding
    return mask


@pytest.mark.parametrize("window", [1, 3, 8])
def test_segment_windows_match_the_slow_reference(window):
    gen = torch.Generator().manual_seed(window)
    for _ in range(20):
        rows, length = 4, 40
        budgeted = _random_mask(gen, rows, length)
        phase = torch.randint(window, (rows,), generator=gen).tolist()
        positions = torch.arange(length).expand(rows, length) + 5  # absolute positions need not start at 0
        groups, n = window_groups(positions, budgeted, BudgetSpec(B=2, window=window, phase=phase))
        assert (groups[~budgeted] == -1).all() and (groups[budgeted] >= 0).all()
        assert n == int(groups.max()) + 1 == len(_partition(groups))  # dense ids
        assert _partition(groups) == _reference(budgeted, window, phase)


def _block_windows(groups: torch.Tensor, run: tuple[int, int], row: int, root: int, window: int) -> list[int]:
    """Per anchor (slow): the window id each position of its verification block [root, root + W) ∩ run reads."""
    return [int(groups[row, t]) for t in range(root, min(root + window, run[1]))]


def _exact(groups: torch.Tensor, row: int, run: tuple[int, int], root: int, window: int) -> bool:
    """The anchor's block is one window and that window is exactly the block (cut at the run's end)."""
    seen = set(_block_windows(groups, run, row, root, window))
    if len(seen) != 1:
        return False
    (g,) = seen
    return set((groups[row] == g).nonzero().flatten().tolist()) == set(range(root, min(root + window, run[1])))


def test_every_anchor_meets_its_own_block_for_exactly_its_phase_and_every_turn_starts_a_block():
    """Per-anchor reference: under phase φ the anchors whose whole block is one window are the run starts (φ = 0)
    and the roots a + φ + jW; over the W phases each root with a whole block in its run is exact for exactly one
    phase. Every response segment's first block (the one serving always verifies) is exact at φ = 0 in every
    segment, which no single absolute offset of the old tiling achieves when segments start at other residues."""
    window, length = 4, 40
    budgeted = torch.zeros(1, length, dtype=torch.bool)
    budgeted[0, 3:17] = True  # response 1 (positions 3..16)
    budgeted[0, 22:35] = True  # response 2 after a user turn: starts at another residue mod W
    positions = torch.arange(length)[None]
    runs = _runs(budgeted[0].tolist())
    hits: dict[int, list[int]] = {}
    for phase in range(window):
        groups, _ = window_groups(positions, budgeted, BudgetSpec(B=2, window=window, phase=[phase]))
        for run in runs:
            for root in range(*run):
                if _exact(groups, 0, run, root, window) and root + window <= run[1]:
                    hits.setdefault(root, []).append(phase)
            assert _exact(groups, 0, run, run[0], window) == (phase == 0 or run[1] - run[0] <= phase)
    full = [root for a, end in runs for root in range(a, end - window + 1)]
    assert sorted(hits) == full and all(len(p) == 1 for p in hits.values())
    for a, _ in runs:
        assert hits[a] == [0]
    # the old absolute tiling: no offset puts both segment starts at a window start
    for offset in range(window):
        groups, _ = window_groups(positions, budgeted, BudgetSpec(B=2, window=window, offset=offset))
        assert not all(_exact(groups, 0, run, run[0], window) for run in runs)


def test_window_phase_is_checked():
    with pytest.raises(VatError, match="phases must lie"):
        BudgetSpec(B=2, window=4, phase=[4])
    with pytest.raises(VatError, match="scope `sequence`"):
        BudgetSpec(B=2, window=4, phase=[0], scope="batch")
    with pytest.raises(VatError, match="2 budget window phases for a batch of 3"):
        window_groups(torch.arange(5).expand(3, 5), torch.ones(3, 5, dtype=torch.bool),
                      BudgetSpec(B=2, window=4, phase=[0, 1]))


def _gap_module():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "budget_gap.py")
    spec = importlib.util.spec_from_file_location("budget_gap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_budget_gap_per_anchor_phase_makes_each_block_one_whole_window():
    """benchmarks/budget_gap.py's per-anchor τ takes each anchor from the phase (root − segment start) mod W: under
    that phase the anchor's block [root, root + W) ∩ its segment is exactly one window (slow per-anchor check)."""
    gap = _gap_module()
    gen = torch.Generator().manual_seed(11)
    window, rows, length = 4, 3, 40
    budgeted = _random_mask(gen, rows, length)
    starts = gap.segment_starts(budgeted)
    positions = torch.arange(length).expand(rows, length)
    checked = 0
    for b in range(rows):
        for run in _runs(budgeted[b].tolist()):
            for root in range(*run):
                assert int(starts[b, root]) == run[0]
                phase = [0] * rows
                phase[b] = (root - int(starts[b, root])) % window
                groups, _ = window_groups(positions, budgeted, BudgetSpec(B=2, window=window, phase=phase))
                assert _exact(groups, b, run, root, window)
                checked += 1
    assert checked > 20 and (starts[~budgeted] == -1).all()
