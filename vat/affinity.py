"""Token → expert affinity table for the expert-union penalty (DESIGN §5).

``A[v, l, e] = P(expert e ∈ top-k at layer l | input token v)`` over the draft vocab rows and the chosen MoE layers
L'. Built online from the routing the trainer captures (EMA counts, smoothed toward the per-layer marginal for rare
tokens) or loaded from a table precomputed by ``vat prep affinity`` (safetensors key ``affinity``, ``(V_rows, L', E)``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vat.errors import VatError, require_file

AFFINITY_KEY = "affinity"


def smoothed_affinity(counts: Tensor, token_counts: Tensor, marginal: Tensor, strength: float) -> Tensor:
    """``A[v] = (counts[v] + s·marginal) / (token_counts[v] + s)``: one row per token, pulled toward the marginal.

    The one smoothing formula of the project (the online EMA table and ``vat prep affinity`` both use it).

    Args:
        counts: (V_rows, L', E) expert selections per row token.
        token_counts: (V_rows,) occurrences of each row token.
        marginal: (L', E) per-layer selection probability over all tokens.
        strength: s, pseudo-occurrences of the marginal in every row.

    Returns:
        (V_rows, L', E) table in the dtype of ``counts``.
    """
    return (counts + strength * marginal) / (token_counts.view(-1, 1, 1) + strength)


class OnlineAffinity(nn.Module):
    """EMA affinity table; an ``nn.Module`` whose buffers go into the checkpoint with :meth:`state_dict`.

    Per update (one call per captured batch) every count is multiplied by ``ema`` and the batch's counts are added:

    * ``counts[v, l, e]``: selections of expert e at layer l when the target read token v;
    * ``token_counts[v]``: occurrences of token v;
    * ``marginal_counts[l, e]`` / ``marginal_total``: the same over every valid token (inside the draft vocab or not).

    The table is ``A[v] = (counts[v] + s·marginal) / (token_counts[v] + s)`` with ``s = prior_strength`` and
    ``marginal = marginal_counts / marginal_total`` (uniform ``top_k / E`` before any data), so a rare token reads as
    the per-layer marginal and each row sums to ``top_k`` per layer (when every token selects ``top_k`` experts).
    A *frozen* table (loaded from ``vat prep affinity``) is returned exactly and never updated.

    Args:
        num_rows: V_rows, the draft vocab size.
        num_layers: L', the MoE layers tracked.
        num_experts: E.
        top_k: experts per token.
        ema: decay per update.
        prior_strength: s, pseudo-occurrences of the marginal in every row.
    """

    def __init__(
        self,
        num_rows: int,
        num_layers: int,
        num_experts: int,
        top_k: int,
        ema: float = 0.99,
        prior_strength: float = 4.0,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= ema <= 1.0:
            raise VatError(f"affinity ema must lie in [0, 1], got {ema}")
        self.num_rows, self.num_layers, self.num_experts, self.top_k = num_rows, num_layers, num_experts, top_k
        self.ema, self.prior_strength = float(ema), float(prior_strength)
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("counts", torch.zeros(num_rows, num_layers, num_experts, **f32))
        self.register_buffer("token_counts", torch.zeros(num_rows, **f32))
        self.register_buffer("marginal_counts", torch.zeros(num_layers, num_experts, **f32))
        self.register_buffer("marginal_total", torch.zeros((), **f32))
        self.register_buffer("frozen", torch.zeros((), dtype=torch.bool, device=device))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long, device=device))

    @torch.no_grad()
    def update(self, rows: Tensor, topk_ids: Tensor, valid: Tensor | None = None) -> None:
        """Fold one batch of captured routing into the EMA counts (no-op for a frozen table).

        Args:
            rows: ``(B, T)`` int64 draft id of each input token (the token the target read), ``-1`` = outside the
                draft vocab (counted in the marginal only).
            topk_ids: ``(L', B, T, k)`` int64 executed expert ids per tracked layer; negative = dropped slot.
            valid: ``(B, T)`` bool positions to count (real tokens); None = all.
        """
        if bool(self.frozen):
            return
        self.fold(*self.select(rows, topk_ids, valid))

    def select(self, rows: Tensor, topk_ids: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The counted tokens of one batch, flat: ``(rows (n,), topk_ids (n, L', k))`` (arguments of :meth:`update`).

        The trainer concatenates these over its micro-batches and processes (rank order) and folds them once per
        optimizer step, so every rank holds the table one process would build from the whole global batch.
        """
        L, B, T, k = topk_ids.shape
        if L != self.num_layers:
            raise VatError(f"affinity tracks {self.num_layers} MoE layers but the routing has {L}")
        dev = self.counts.device
        ok = torch.ones(B, T, dtype=torch.bool, device=dev) if valid is None else valid.to(dev).bool()  # (B, T)
        ids = topk_ids.to(dev).long().permute(1, 2, 0, 3)[ok]  # (n, L', k) experts of every counted token
        return rows.to(dev).long()[ok], ids

    @torch.no_grad()
    def fold(self, r: Tensor, ids: Tensor) -> None:
        """One EMA update from flat tokens (:meth:`select`): decay every count once, then add these tokens' counts.

        Adding ones commutes, so the result does not depend on the order of the tokens (or of the ranks they came
        from). No-op for a frozen table.
        """
        if bool(self.frozen):
            return
        dev = self.counts.device
        r, ids = r.to(dev).long(), ids.to(dev).long()
        L = self.num_layers
        sel = ids >= 0  # (n, L', k)
        layer = torch.arange(L, device=dev).view(1, L, 1).expand_as(ids)  # (n, L', k)

        self.counts.mul_(self.ema)
        self.token_counts.mul_(self.ema)
        self.marginal_counts.mul_(self.ema)
        self.marginal_total.mul_(self.ema)

        ones = torch.ones_like(ids, dtype=torch.float32)
        self.marginal_counts.index_put_((layer[sel], ids[sel]), ones[sel], accumulate=True)
        self.marginal_total.add_(float(r.numel()))
        in_vocab = r >= 0  # (n,)
        rr = r.view(-1, 1, 1).expand_as(ids)  # (n, L', k)
        m = sel & in_vocab.view(-1, 1, 1)
        self.counts.index_put_((rr[m], layer[m], ids[m]), ones[m], accumulate=True)
        self.token_counts.index_put_((r[in_vocab],), torch.ones_like(r[in_vocab], dtype=torch.float32), accumulate=True)
        self.updates.add_(1)

    def marginal(self) -> Tensor:
        """``(L', E)`` fp32 per-layer marginal selection probability (rows sum to ``top_k``)."""
        uniform = torch.full_like(self.marginal_counts, self.top_k / self.num_experts)
        if float(self.marginal_total) <= 0:
            return uniform
        return self.marginal_counts / self.marginal_total

    @torch.no_grad()
    def table(self) -> Tensor:
        """``(V_rows, L', E)`` fp32 affinity table (the argument of :func:`vat.losses.expected_expert_use`)."""
        if bool(self.frozen):
            return self.counts / self.token_counts.clamp_min(1e-30).view(-1, 1, 1)
        return smoothed_affinity(self.counts, self.token_counts, self.marginal(), self.prior_strength)

    @torch.no_grad()
    def load_table(self, table: Tensor, frozen: bool = True, pseudo_count: float = 100.0) -> None:
        """Initialise from a precomputed ``(V_rows, L', E)`` table.

        Args:
            table: the table (rows of ``vat prep affinity``).
            frozen: keep it exactly (no online updates); else it seeds the EMA as ``pseudo_count`` occurrences per row.
            pseudo_count: occurrences the table stands for when not frozen.
        """
        if tuple(table.shape) != tuple(self.counts.shape):
            raise VatError(
                f"affinity table has shape {tuple(table.shape)}, expected (draft_vocab_size, moe_layers, num_experts) "
                f"= {tuple(self.counts.shape)}"
            )
        table = table.to(self.counts.device, torch.float32)
        n = 1.0 if frozen else float(pseudo_count)
        self.counts.copy_(table * n)
        self.token_counts.fill_(n)
        self.marginal_counts.copy_(table.mean(0) * n)
        self.marginal_total.fill_(n)
        self.frozen.fill_(bool(frozen))

    @classmethod
    def from_file(
        cls,
        path: str,
        top_k: int,
        ema: float = 0.99,
        prior_strength: float = 4.0,
        frozen: bool = True,
        device: torch.device | None = None,
    ) -> OnlineAffinity:
        """Load a table written by ``vat prep affinity`` (safetensors key ``affinity``, ``(V_rows, L', E)``)."""
        from safetensors.torch import load_file

        tensors = load_file(require_file(path, "affinity table"))
        if AFFINITY_KEY not in tensors:
            raise VatError(f"{path} has no `{AFFINITY_KEY}` tensor (keys: {sorted(tensors)})")
        table = tensors[AFFINITY_KEY]
        if table.dim() != 3:
            raise VatError(f"{path}: `{AFFINITY_KEY}` must be (V_rows, L', E), got shape {tuple(table.shape)}")
        out = cls(*table.shape, top_k=top_k, ema=ema, prior_strength=prior_strength, device=device)
        out.load_table(table, frozen=frozen)
        return out
