"""EcoSpec's context-aware expert predictor: a probe on the draft's hidden state (`vat prep expert-probe`).

The affinity table (:class:`vat.eval.ecospec.ExpertPredictor`) predicts a drafted token's experts from the token
alone. The target routes a token by its hidden state at that position, which depends on the context, so the same
token routes differently in different places. The probe reads the context through the hidden state the draft produced
the token from (a tree node's ``parent_hidden``), on top of the table's prior::

    P(e ∈ top-k at layer l | node) = σ(W_{l,e} · h + b_{l,e} + γ_{l,e} · logit A[token, l, e])

W (L'·E, H), b and γ (L'·E) are fitted by binary cross-entropy on pairs captured from the target and the draft over
a prepared dataset: at anchor t and draft step k of the training-time-test unroll, the draft's state h(t, k) (what
produced its guess of token t + 2 + k) and the experts the target executed at position t + 2 + k. Rows are split
by sequence: the first ``1 − holdout`` of the rows fit the probe, the rest measure it against the table alone
(top-k recall per layer and binary cross-entropy), and the report says which predictor is better there.

The probe's file is an affinity file with three more tensors (``probe_weight``, ``probe_bias``, ``probe_prior_scale``):
``--affinity FILE`` loads it as EcoSpec's predictor, and a reader that knows only tables still reads its table.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from vat.errors import VatError

PROBE_KEYS = ("probe_weight", "probe_bias", "probe_prior_scale")
PRIOR_EPS = 1e-4  # the table's probabilities are clamped to [eps, 1 - eps] before the logit


@dataclass
class ExpertProbe:
    """The fitted probe.

    Attributes:
        weight: (L'·E, H) fp32.
        bias: (L'·E,) fp32.
        prior_scale: (L'·E,) fp32, γ: how much of the table's logit the probe keeps.
        layers: L'.
        experts: E.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    prior_scale: torch.Tensor
    layers: int
    experts: int

    def logits(self, hidden: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        """``hidden (n, H)``, ``prior (n, L', E)`` table probabilities -> (n, L', E) logits."""
        prior_logit = torch.logit(prior.float().clamp(PRIOR_EPS, 1 - PRIOR_EPS)).flatten(1)  # (n, L'E)
        z = hidden.float() @ self.weight.T + self.bias + self.prior_scale * prior_logit
        return z.view(-1, self.layers, self.experts)

    def __call__(self, hidden: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        """(n, L', E) probabilities."""
        return torch.sigmoid(self.logits(hidden, prior))


def fit_probe(hidden: torch.Tensor, prior: torch.Tensor, labels: torch.Tensor, epochs: int = 60,
              batch_size: int = 4096, lr: float = 3e-3, seed: int = 0) -> ExpertProbe:
    """Fit W, b, γ by binary cross-entropy (Adam, mini-batches), starting from the table itself (W = 0, b = 0, γ = 1).

    Args:
        hidden: (M, H) draft states.
        prior: (M, L', E) the table's probabilities for the drafted tokens.
        labels: (M, L', E) bool, the experts the target executed.
        epochs: passes over the pairs.
        batch_size: pairs per step.
        lr: Adam's learning rate.
        seed: the shuffle.
    """
    M, H = hidden.shape
    layers, experts = labels.shape[1:]
    n = layers * experts
    probe = ExpertProbe(torch.zeros(n, H, requires_grad=True), torch.zeros(n, requires_grad=True),
                        torch.ones(n, requires_grad=True), layers, experts)
    params = [probe.weight, probe.bias, probe.prior_scale]
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    target = labels.float()
    for _ in range(epochs):
        for idx in torch.randperm(M, generator=gen).split(batch_size):
            loss = F.binary_cross_entropy_with_logits(probe.logits(hidden[idx], prior[idx]), target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return ExpertProbe(*(p.detach().clone() for p in params), layers, experts)


def topk_recall(probs: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Mean over pairs and layers of |top-k(probs) ∩ executed| / |executed|: how many of a token's real experts the
    predictor's k best cover. ``probs``, ``labels``: (M, L', E)."""
    top = probs.topk(k, dim=-1).indices  # (M, L', k)
    hit = labels.gather(-1, top).float().sum(-1)  # (M, L')
    return float((hit / labels.float().sum(-1).clamp_min(1)).mean())


def predictor_quality(probs: torch.Tensor, labels: torch.Tensor, k: int) -> dict[str, float]:
    """Top-k recall and binary cross-entropy (nats per expert slot) of a predictor on labelled pairs."""
    bce = F.binary_cross_entropy(probs.float().clamp(PRIOR_EPS, 1 - PRIOR_EPS), labels.float())
    return {"topk_recall": topk_recall(probs, labels, k), "bce": float(bce)}


@torch.no_grad()
def capture_pairs(target, drafter, rows: list[list[int]], steps: int, table, ordinals: list[int],
                  progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The probe's training pairs from the target and the draft over token rows, one row at a time.

    Args:
        target: the :class:`vat.target.FrozenTarget` (aux layers set to the draft's).
        drafter: the EAGLE-3 draft (embedding set).
        rows: token id lists (a prepared dataset's ``input_ids``).
        steps: TTT steps per anchor (the tree's depth is what the probe serves).
        table: the :class:`vat.eval.ecospec.ExpertPredictor` whose table is the prior.
        ordinals: the MoE-layer ordinals the table's layers are (labels are taken at those).
        progress: a progress bar.

    Returns:
        ``(hidden (M, H), prior (M, L', E), labels (M, L', E) bool, row (M,) int64)``: ``row`` is each pair's index
        in ``rows`` (the fit / held-out split is by row).
    """
    from tqdm.auto import tqdm

    hiddens, priors, labels, row_of = [], [], [], []
    E = target.num_experts
    for r, row in enumerate(tqdm(rows, desc="expert probe: capture", disable=not progress)):
        ids = torch.tensor([row], device=target.device)  # (1, T)
        T = ids.shape[1]
        if T < 3:
            continue
        out = target.forward(ids, output_aux=True)
        ttt = drafter.ttt_forward(out.aux_hidden, ids, ttt_steps=steps)  # hidden (1, T, K, H)
        for k in range(min(steps, T - 2)):
            pos = torch.arange(k + 2, T, device=ids.device)  # positions the step-k guesses are read at
            h = ttt.hidden[0, : T - 2 - k, k]  # (n, H) the state that produced each guess
            routed = out.topk_ids[ordinals][:, 0, pos]  # (L', n, k_top) executed ids (sentinel E = dropped)
            onehot = torch.zeros(routed.shape[0], routed.shape[1], E + 1, dtype=torch.bool, device=ids.device)
            onehot.scatter_(-1, routed, True)
            hiddens.append(h.float().cpu())
            priors.append(table(ids[0, pos].tolist()))
            labels.append(onehot[..., :E].permute(1, 0, 2).cpu())  # (n, L', E)
            row_of.append(torch.full((h.shape[0],), r, dtype=torch.long))
    if not hiddens:
        raise VatError("no sequence of at least 3 tokens to capture expert-probe pairs from")
    return torch.cat(hiddens), torch.cat(priors), torch.cat(labels), torch.cat(row_of)


def save_probe(path: str, probe: ExpertProbe, table_file: str, report: dict) -> None:
    """The table file's tensors and metadata plus the probe's (one file ``--affinity`` reads)."""
    with safe_open(table_file, "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys() if key not in PROBE_KEYS}
        meta = dict(f.metadata() or {})
    tensors.update({"probe_weight": probe.weight.contiguous(), "probe_bias": probe.bias.contiguous(),
                    "probe_prior_scale": probe.prior_scale.contiguous()})
    meta.update({"expert_probe": json.dumps(report)})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path, metadata=meta)


def load_probe(path: str) -> ExpertProbe | None:
    """The probe stored beside a table (None for a plain affinity file)."""
    with safe_open(path, "pt") as f:
        if "probe_weight" not in f.keys():
            return None
        weight, bias, scale = (f.get_tensor(k).float() for k in PROBE_KEYS)
        table_shape = f.get_slice("affinity").get_shape()
    layers, experts = int(table_shape[1]), int(table_shape[2])
    if weight.shape[0] != layers * experts:
        raise VatError(f"{path}: the probe predicts {weight.shape[0]} expert slots, its table has {layers} x {experts}")
    return ExpertProbe(weight, bias, scale, layers, experts)


def table_ordinals(path: str, moe_layer_ids: list[int], n_layers: int) -> list[int]:
    """The MoE-layer ordinals of an affinity file's layers (its ``layers`` tensor; all MoE layers without one)."""
    with safe_open(path, "pt") as f:
        layers = f.get_tensor("layers").tolist() if "layers" in f.keys() else None
    if layers is None:
        if n_layers != len(moe_layer_ids):
            raise VatError(f"{path} has {n_layers} layers and no `layers` tensor; the target has {len(moe_layer_ids)}")
        return list(range(n_layers))
    missing = [layer for layer in layers if layer not in moe_layer_ids]
    if missing:
        raise VatError(f"{path}: layers {missing} are not MoE layers of this target ({moe_layer_ids})")
    return [moe_layer_ids.index(layer) for layer in layers]


def main(args) -> int:
    """Entry point of ``vat prep expert-probe``: capture, fit on the first rows, measure on the held-out rows, save."""
    from vat.data_prep.vocab import load_prepared_dataset
    from vat.drafters.eagle3 import Eagle3Drafter
    from vat.drafters.eagle3_config import check_draft_matches_target
    from vat.eval.ecospec import AFFINITY_FILE, ExpertPredictor
    from vat.export.checkpoint import load_draft
    from vat.target import load_target

    t0 = time.time()
    drafter, cfg = load_draft(args.draft)
    if not isinstance(drafter, Eagle3Drafter):
        raise VatError(f"{args.draft}: the expert probe reads an EAGLE-3 draft's states (EcoSpec chooses tree nodes)")
    target = load_target(args.target or cfg.target_path, dtype="float32", device="cpu",
                         aux_layer_ids=cfg.aux_layer_ids)
    try:
        check_draft_matches_target(cfg, target.hidden_size, target.vocab_size, target.num_layers)
        drafter.set_embedding(target.embed_tokens().weight)
        drafter.to(dtype=target.dtype).eval()
        table_file = args.affinity or os.path.join(args.draft, AFFINITY_FILE)
        table = ExpertPredictor.load(table_file, target.vocab_size, getattr(drafter, "t2d", None))
        ordinals = table_ordinals(table_file, target.moe_layer_ids, table.table.shape[1])
        ds = load_prepared_dataset(args.data)
        rows = [list(r)[: args.max_length] for r in ds["input_ids"][: args.limit]]
        hidden, prior, labels, row_of = capture_pairs(target, drafter, rows, args.steps, table, ordinals,
                                                      progress=True)
    finally:
        target.close()
    fit = row_of < max(1, int(len(rows) * (1 - args.holdout)))  # (M,) the first rows fit, the rest are held out
    held = ~fit
    if not bool(held.any()):
        raise VatError(f"--holdout {args.holdout} leaves no row to measure the probe on: use more rows or a larger one")
    probe = fit_probe(hidden[fit], prior[fit], labels[fit], epochs=args.epochs)
    k = int(labels[0, 0].sum())
    report = {
        "pairs_fit": int(fit.sum()), "pairs_heldout": int(held.sum()), "rows": len(rows), "steps": args.steps,
        "top_k": k, "table": predictor_quality(prior[held], labels[held], k),
        "probe": predictor_quality(probe(hidden[held], prior[held]), labels[held], k),
        "data": os.path.abspath(args.data), "draft": os.path.abspath(args.draft), "seconds": time.time() - t0,
    }
    save_probe(args.output, probe, table.source, report)
    print(f"expert probe: {report['pairs_fit']} pairs fit, {report['pairs_heldout']} held out; held-out top-{k} recall "
          f"table {report['table']['topk_recall']:.3f} -> probe {report['probe']['topk_recall']:.3f}, BCE "
          f"{report['table']['bce']:.4f} -> {report['probe']['bce']:.4f}; {report['seconds']:.0f} s -> {args.output}")
    return 0
