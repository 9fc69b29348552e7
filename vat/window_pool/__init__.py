"""Window Pool (docs/window_pool.md): continued pretraining of an MoE target's routers so that the tokens of one window share
a pool of experts, and its evaluation.

* :mod:`vat.window_pool.pools`: the per-step constraint (W, d_w, window offset) and the pool-mass term;
* :mod:`vat.window_pool.data`: the target's pretraining-style text (train rows and held-out sequences);
* :mod:`vat.window_pool.train`: ``vat train`` with ``kind: window_pool`` (writes a target directory);
* :mod:`vat.window_pool.evaluate`: ``vat profile --perplexity-grid``: held-out perplexity of targets side by side
  under W x d_w window-sharing constraints and hard budgets B.

The pools are chosen by the MoE-Spec budget code itself (:mod:`vat.target.budget`) through the one router hook
(:mod:`vat.target.routing`).
"""
