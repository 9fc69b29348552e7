"""Token → expert affinity table for the expert-union penalty (docs/vat_losses.md).

``A[v, l, e] = P(expert e ∈ top-k at layer l | input token v)`` over the draft vocab rows and the chosen MoE layers
L'. Built online from the routing the trainer captures (EMA counts, smoothed toward the per-layer marginal for rare
tokens) or loaded from a table precomputed by ``vat prep affinity`` (safetensors key ``affinity``, ``(V_rows, L', E)``).
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from vat.errors import VatError, require_file

AFFINITY_KEY = "affinity"
STORAGES = ("float32", "uint16")
Q_SCALE = 65535.0  # uint16 fixed point of P in [0, 1]
TABLE_CHUNK = 4096  # rows per chunk when building the compact table


def _to_q(p: Tensor) -> Tensor:
    """P in [0, 1] (fp32) -> uint16 fixed-point bits stored in int16."""
    q = torch.round(p.clamp(0.0, 1.0) * Q_SCALE).to(torch.int32)
    return torch.where(q > 32767, q - 65536, q).to(torch.int16)


def _from_q(q: Tensor) -> Tensor:
    """uint16 fixed-point bits (in int16) -> P in fp32."""
    return (q.to(torch.int32) & 0xFFFF).to(torch.float32) / Q_SCALE


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

    **Compact storage** (``storage="uint16"``, for 128-expert targets: a dense fp32 table of a 32k draft vocab x 48
    layers x 128 experts is 786 MB, and :meth:`table` another as much every step): the rows are kept as
    ``P[v] = counts[v] / token_counts[v]`` in uint16 fixed point (``round(P · 65535)``) beside the fp32
    ``token_counts``, which is the same state (``counts = token_counts · P``): a row the batch does not touch keeps
    its P (numerator and denominator decay alike), a touched row is recomputed in fp32 and re-rounded. Each rounding
    is ≤ 0.5/65535 and its effect decays by ``ema`` per update, so the error stays below ``0.5/65535/(1 - ema)``
    (7.6e-4 at ema 0.99) — the table equals the dense one to that, in half its bytes; :meth:`table` is fp16
    (what :func:`vat.losses.expected_expert_use` gathers rows of, in fp32). ``layer_stride`` s keeps every s-th of
    the routing's MoE layers (``layer_index``): the union penalty then runs over those layers.

    Args:
        num_rows: V_rows, the draft vocab size.
        num_layers: L', the MoE layers of the routing fed to :meth:`select` (all of them are tracked unless
            ``layer_stride`` > 1).
        num_experts: E.
        top_k: experts per token.
        ema: decay per update.
        prior_strength: s, pseudo-occurrences of the marginal in every row.
        storage: ``float32`` (dense EMA counts) or ``uint16`` (the compact rows above).
        layer_stride: track MoE layers ``0, s, 2s, ...`` of the routing.
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
        storage: str = "float32",
        layer_stride: int = 1,
    ) -> None:
        super().__init__()
        if not 0.0 <= ema <= 1.0:
            raise VatError(f"affinity ema must lie in [0, 1], got {ema}")
        if storage not in STORAGES:
            raise VatError(f"affinity storage must be one of {list(STORAGES)}, got `{storage}`")
        if layer_stride < 1:
            raise VatError(f"affinity layer stride must be >= 1, got {layer_stride}")
        self.num_rows, self.num_layers, self.num_experts, self.top_k = num_rows, num_layers, num_experts, top_k
        self.ema, self.prior_strength = float(ema), float(prior_strength)
        self.storage = storage
        self.layer_index = list(range(0, num_layers, layer_stride))  # tracked positions among the routing's layers
        tracked = len(self.layer_index)
        f32 = dict(dtype=torch.float32, device=device)
        if storage == "uint16":  # P[v] in fixed point; torch has no uint16 arithmetic, the bits live in int16
            self.register_buffer("probs_q", torch.zeros(num_rows, tracked, num_experts, dtype=torch.int16,
                                                        device=device))
        else:
            self.register_buffer("counts", torch.zeros(num_rows, tracked, num_experts, **f32))
        self.register_buffer("token_counts", torch.zeros(num_rows, **f32))
        self.register_buffer("marginal_counts", torch.zeros(tracked, num_experts, **f32))
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
        dev = self.token_counts.device
        ok = torch.ones(B, T, dtype=torch.bool, device=dev) if valid is None else valid.to(dev).bool()  # (B, T)
        if len(self.layer_index) != L:
            topk_ids = topk_ids[self.layer_index]  # (L'', B, T, k) the strided layers
        ids = topk_ids.to(dev).long().permute(1, 2, 0, 3)[ok]  # (n, L'', k) experts of every counted token
        return rows.to(dev).long()[ok], ids

    @torch.no_grad()
    def fold(self, r: Tensor, ids: Tensor) -> None:
        """One EMA update from flat tokens (:meth:`select`): decay every count once, then add these tokens' counts.

        Adding ones commutes, so the result does not depend on the order of the tokens (or of the ranks they came
        from). No-op for a frozen table.
        """
        if bool(self.frozen):
            return
        dev = self.token_counts.device
        r, ids = r.to(dev).long(), ids.to(dev).long()
        L = len(self.layer_index)
        sel = (ids >= 0) & (ids < self.num_experts)  # (n, L'', k) executed slots
        layer = torch.arange(L, device=dev).view(1, L, 1).expand_as(ids)  # (n, L'', k)

        if self.storage == "float32":
            self.counts.mul_(self.ema)
        self.token_counts.mul_(self.ema)
        self.marginal_counts.mul_(self.ema)
        self.marginal_total.mul_(self.ema)

        ones = torch.ones_like(ids, dtype=torch.float32)
        self.marginal_counts.index_put_((layer[sel], ids[sel]), ones[sel], accumulate=True)
        self.marginal_total.add_(float(r.numel()))
        in_vocab = r >= 0  # (n,)
        m = sel & in_vocab.view(-1, 1, 1)
        if self.storage == "float32":
            rr = r.view(-1, 1, 1).expand_as(ids)  # (n, L'', k)
            self.counts.index_put_((rr[m], layer[m], ids[m]), ones[m], accumulate=True)
            self.token_counts.index_put_((r[in_vocab],), torch.ones_like(r[in_vocab], dtype=torch.float32),
                                         accumulate=True)
        else:
            self._fold_compact(r, ids, layer, m, in_vocab)
        self.updates.add_(1)

    def _fold_compact(self, r: Tensor, ids: Tensor, layer: Tensor, m: Tensor, in_vocab: Tensor) -> None:
        """The touched rows of the uint16 table: ``P ← (tc·P + c) / (tc + n)`` with the decayed ``tc`` (fp32)."""
        rows, local = torch.unique(r[in_vocab], return_inverse=True)  # (u,), (n_in,)
        if rows.numel() == 0:
            return
        pos = torch.full_like(r, -1)
        pos[in_vocab] = local  # (n,) compact row of each token
        batch = torch.zeros(rows.numel(), *self.probs_q.shape[1:], dtype=torch.float32, device=r.device)  # (u, L'', E)
        pp = pos.view(-1, 1, 1).expand_as(ids)  # (n, L'', k)
        batch.index_put_((pp[m], layer[m], ids[m]), torch.ones_like(ids[m], dtype=torch.float32), accumulate=True)
        occurrences = torch.bincount(local, minlength=rows.numel()).to(torch.float32)  # (u,)
        tc = self.token_counts[rows]  # (u,) already decayed
        new_tc = tc + occurrences
        p = (tc.view(-1, 1, 1) * _from_q(self.probs_q[rows]) + batch) / new_tc.view(-1, 1, 1)  # (u, L'', E)
        self.probs_q[rows] = _to_q(p)
        self.token_counts[rows] = new_tc

    def marginal(self) -> Tensor:
        """``(L', E)`` fp32 per-layer marginal selection probability (rows sum to ``top_k``)."""
        uniform = torch.full_like(self.marginal_counts, self.top_k / self.num_experts)
        if float(self.marginal_total) <= 0:
            return uniform
        return self.marginal_counts / self.marginal_total

    @torch.no_grad()
    def table(self) -> Tensor:
        """``(V_rows, L'', E)`` affinity table (the argument of :func:`vat.losses.expected_expert_use`): fp32 for
        the dense storage, fp16 for the compact one (built in row chunks: no full fp32 intermediate)."""
        if self.storage == "float32":
            if bool(self.frozen):
                return self.counts / self.token_counts.clamp_min(1e-30).view(-1, 1, 1)
            return smoothed_affinity(self.counts, self.token_counts, self.marginal(), self.prior_strength)
        out = torch.empty(self.probs_q.shape, dtype=torch.float16, device=self.probs_q.device)
        frozen, marginal = bool(self.frozen), self.marginal()
        for lo in range(0, self.num_rows, TABLE_CHUNK):
            p = _from_q(self.probs_q[lo : lo + TABLE_CHUNK])  # (c, L'', E)
            if not frozen:
                tc = self.token_counts[lo : lo + TABLE_CHUNK]
                p = smoothed_affinity(tc.view(-1, 1, 1) * p, tc, marginal, self.prior_strength)
            out[lo : lo + TABLE_CHUNK] = p.to(torch.float16)
        return out

    @torch.no_grad()
    def load_table(self, table: Tensor, frozen: bool = True, pseudo_count: float = 100.0) -> None:
        """Initialise from a precomputed ``(V_rows, L', E)`` table.

        Args:
            table: the table (rows of ``vat prep affinity``).
            frozen: keep it exactly (no online updates); else it seeds the EMA as ``pseudo_count`` occurrences per row.
            pseudo_count: occurrences the table stands for when not frozen.
        """
        shape = (self.num_rows, len(self.layer_index), self.num_experts)
        if tuple(table.shape) != shape:
            raise VatError(
                f"affinity table has shape {tuple(table.shape)}, expected (draft_vocab_size, moe_layers, num_experts) "
                f"= {shape}"
            )
        table = table.to(self.token_counts.device, torch.float32)
        n = 1.0 if frozen else float(pseudo_count)
        if self.storage == "float32":
            self.counts.copy_(table * n)
        else:
            self.probs_q.copy_(_to_q(table))
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
        tensors = load_file(require_file(path, "affinity table"))
        if AFFINITY_KEY not in tensors:
            raise VatError(f"{path} has no `{AFFINITY_KEY}` tensor (keys: {sorted(tensors)})")
        table = tensors[AFFINITY_KEY]
        if table.dim() != 3:
            raise VatError(f"{path}: `{AFFINITY_KEY}` must be (V_rows, L', E), got shape {tuple(table.shape)}")
        out = cls(*table.shape, top_k=top_k, ema=ema, prior_strength=prior_strength, device=device)
        out.load_table(table, frozen=frozen)
        return out
