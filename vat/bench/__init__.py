"""`vat bench`: seeds x methods -> trained drafts -> real evaluation -> τ per benchmark with bootstrap intervals.

Modules, one job each: :mod:`~vat.bench.stats` (pooled τ, bootstrap intervals, paired ratios; pure numpy),
:mod:`~vat.bench.cells` (the cells and their resumable train / eval stages), :mod:`~vat.bench.summary` (bench.json,
bench.md) with :mod:`~vat.bench.offload` (its expert-offload section) and :mod:`~vat.bench.text` (cell formats),
:mod:`~vat.bench.plots` (PNGs), :mod:`~vat.bench.record` (committable records) and :mod:`~vat.bench.run` (the entry
point). Kept free of imports so ``vat --help`` stays fast. See ``docs/bench.md``.
"""
