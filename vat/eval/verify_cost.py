"""The verification-cost profile EVICT reads: expert union and modeled time against the verify width.

For each width w (verified tokens: the root plus w - 1 drafts) the profile holds the mean expert union per MoE layer
of a w-token verification block, the modeled time of verifying w tokens on the cost model's accelerator at the
profile's mean context (:mod:`vat.eval.cost`), and (for a profile of text) the wall time of that forward measured on
this device, for reference. Two sources:

* **drafted blocks** (:class:`DraftedUnionRecorder`, what ``vat eval --tree-policy evict`` builds per draft and
  benchmark during its calibration pass on held-out prompts): the draft's own chains or trees, verified uncut; the
  union at width w is that of the block's first w positions (the root, then the drafted nodes in the order the tree
  ranked them: the prefixes EVICT's cut keeps), each position routed as the verification forward routed it;
* **the target's own text** (:func:`build_verify_cost`, ``vat profile --verify-widths`` and EVICT's fallback): w
  consecutive positions of the prompt and its greedy answer (what a block holds when every draft is accepted).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from vat.errors import VatError
from vat.eval.engine import SpeculativeEngine
from vat.eval.policies import RoundPolicy
from vat.target import window_union
from vat.target.cache import crop_cache, new_cache

DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class VerifyCostTable:
    """Expert union (and time) per verify width.

    Attributes:
        widths: verify widths w, increasing.
        union: (len(widths), L') mean experts per MoE layer over windows of w positions of the target's own text.
        modeled_seconds: modeled verification time per width at ``context`` (None when not modeled).
        measured_seconds: wall seconds of a forward of w tokens on ``device`` (None when not measured).
        context: the mean context (cached positions) the times were taken at.
        accelerator: the cost model's accelerator of ``modeled_seconds``.
        device: where ``measured_seconds`` ran.
        source: where the table came from.
        n_texts: texts profiled.
    """

    widths: list[int]
    union: list[list[float]]
    modeled_seconds: list[float] | None = None
    measured_seconds: list[float] | None = None
    context: float = 0.0
    accelerator: str | None = None
    device: str | None = None
    source: str = ""
    n_texts: int = 0

    def union_at(self, width: int) -> list[float]:
        """Mean union per MoE layer at ``width``: linear between profiled widths, the last slope beyond them."""
        ws = self.widths
        if width <= ws[0]:
            return list(self.union[0])
        for i in range(1, len(ws)):
            if width <= ws[i]:
                f = (width - ws[i - 1]) / (ws[i] - ws[i - 1])
                return [a + f * (b - a) for a, b in zip(self.union[i - 1], self.union[i])]
        if len(ws) == 1:
            return list(self.union[-1])
        f = (width - ws[-1]) / (ws[-1] - ws[-2])
        return [b + f * (b - a) for a, b in zip(self.union[-2], self.union[-1])]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> VerifyCostTable:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def load_verify_cost(path: str, num_moe_layers: int | None = None) -> VerifyCostTable:
    """The ``verify_cost`` table of a ``vat profile`` output (profile.json, or its directory).

    Raises:
        VatError: a missing file, a profile without ``verify_cost``, or one for a target with another layer count.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "profile.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError:
        raise VatError(f"--verify-cost {path}: no such file (write it with `vat profile --verify-widths ...`)") from None
    except ValueError as err:
        raise VatError(f"--verify-cost {path}: not JSON ({err})") from None
    section = data.get("verify_cost", data) if isinstance(data, dict) else None
    if not isinstance(section, dict) or "widths" not in section or "union" not in section:
        raise VatError(f"--verify-cost {path}: no `verify_cost` table (run `vat profile --verify-widths ...`)")
    table = VerifyCostTable.from_dict(section)
    if num_moe_layers is not None and any(len(row) != num_moe_layers for row in table.union):
        raise VatError(f"--verify-cost {path}: profiled {len(table.union[0])} MoE layers, the target has "
                       f"{num_moe_layers}: a profile of another target")
    table.source = table.source or path
    return table


def own_texts(target, prompts_ids: Sequence[Sequence[int]], new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy answer) pairs: the target's own continuation of each prompt, ``new_tokens`` long at most."""
    engine = SpeculativeEngine(target, None, max_new_tokens=new_tokens)
    return [(list(p), engine.generate(list(p)).token_ids) for p in prompts_ids]


@torch.no_grad()
def build_verify_cost(target, texts: Sequence[tuple[Sequence[int], Sequence[int]]], widths: Sequence[int],
                      cost=None, measure: bool = True, source: str = "") -> VerifyCostTable:
    """Profile the expert union (and the time) of verifying w tokens of the target's own text.

    Args:
        target: a :class:`vat.target.FrozenTarget`.
        texts: (prompt ids, answer ids) pairs; windows tile the block positions, from the prompt's last token (the
            first root) through the answer.
        widths: verify widths to profile.
        cost: a :class:`vat.eval.cost.CostModel` for ``modeled_seconds`` (None = not modeled).
        measure: time a forward of w tokens over the prompt's KV cache on the target's device.
        source: recorded in the table.

    Returns:
        A :class:`VerifyCostTable` (widths with no full window in any text are left out).
    """
    widths = sorted({int(w) for w in widths if int(w) >= 1})
    if not widths:
        raise VatError("--verify-widths needs at least one width >= 1")
    device = target.device
    sums = {w: torch.zeros(len(target.moe_layer_ids), dtype=torch.float64) for w in widths}
    counts = dict.fromkeys(widths, 0)
    wall = {w: [] for w in widths}
    contexts = []
    for prompt, answer in texts:
        ids = torch.tensor([list(prompt) + list(answer)], device=device)  # (1, P + G)
        start = len(prompt) - 1  # the first verification block starts at the prompt's last token
        out = target.forward(ids, output_aux=False)
        span = ids.shape[1] - start
        contexts.append(start + span / 2)
        for w in widths:
            n_win = span // w
            if n_win == 0:
                continue
            pos = torch.arange(ids.shape[1], device=device)
            groups = torch.where(pos >= start, (pos - start) // w, torch.full_like(pos, -1))
            groups = torch.where(groups < n_win, groups, torch.full_like(groups, -1))[None]  # (1, T)
            union = window_union(out.topk_ids, groups, n_win, target.num_experts)  # (L', n_win)
            sums[w] += union.double().sum(dim=1).cpu()
            counts[w] += n_win
            if measure:
                cache = new_cache()
                target.forward(ids[:, :start], past_key_values=cache, use_cache=True, output_aux=False)
                _sync(device)
                t0 = time.perf_counter()
                target.forward(ids[:, start:start + w], past_key_values=cache, use_cache=True, output_aux=False)
                _sync(device)
                wall[w].append(time.perf_counter() - t0)
                crop_cache(cache, 0)
    kept = [w for w in widths if counts[w]]
    if not kept:
        raise VatError("no text long enough for any verify width")
    union = [[float(u) for u in sums[w] / counts[w]] for w in kept]
    context = sum(contexts) / len(contexts)
    table = VerifyCostTable(widths=kept, union=union, context=context, source=source, n_texts=len(texts),
                            device=str(device) if measure else None)
    if measure:
        table.measured_seconds = [sum(wall[w]) / len(wall[w]) for w in kept]
    if cost is not None:
        table.accelerator = cost.accelerator.name
        table.modeled_seconds = [cost.verify(w, int(round(context)), u) for w, u in zip(kept, union)]
    return table


class DraftedUnionRecorder(RoundPolicy):
    """Round hooks that profile the expert union of a draft's own verification blocks, width by width.

    Every verification forward (``executed``) adds, for w = 1 .. its block size, the union per MoE layer of the block's
    first w positions; the context of each block comes from the cut hooks (called just before verification). The
    block is verified uncut when this runs beside :class:`vat.eval.calibration.CalibrationRecorder`.
    """

    observes_experts = True

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.sums: dict[int, torch.Tensor] = {}  # width -> (L',) summed unions
        self.counts: dict[int, int] = {}
        self.contexts: list[int] = []

    def cut_chain(self, draft, context: int, mode: str):
        """Note the block's context; keep the chain."""
        self.contexts.append(context)
        return draft

    def cut_tree(self, tree, context: int, top_k: int):
        """Note the block's context; keep the tree."""
        self.contexts.append(context)
        return tree

    def executed(self, expert_sets: list[list[int]], ids: torch.Tensor) -> None:
        """(L', T, k) executed ids of one block: the union of its first w positions for every w <= T."""
        L, T = ids.shape[:2]
        onehot = torch.zeros(L, T, self.num_experts + 1, dtype=torch.bool)
        onehot.scatter_(-1, ids.long(), True)
        covered = onehot[..., : self.num_experts].cummax(dim=1).values  # (L', T, E): experts in positions < w + 1
        union = covered.sum(-1).double()  # (L', T): union of the first w = 1..T positions
        for w in range(1, T + 1):
            self.sums[w] = self.sums.get(w, torch.zeros(L, dtype=torch.float64)) + union[:, w - 1]
            self.counts[w] = self.counts.get(w, 0) + 1

    def table(self, cost=None, source: str = "") -> VerifyCostTable | None:
        """The profile of the blocks seen (None before any), with modeled times on ``cost``'s accelerator."""
        widths = sorted(self.counts)
        if not widths:
            return None
        union = [[float(u) for u in self.sums[w] / self.counts[w]] for w in widths]
        context = sum(self.contexts) / len(self.contexts) if self.contexts else 0.0
        table = VerifyCostTable(widths=widths, union=union, context=context, source=source,
                                n_texts=self.counts[widths[0]])
        if cost is not None:
            table.accelerator = cost.accelerator.name
            table.modeled_seconds = [cost.verify(w, int(round(context)), u) for w, u in zip(widths, union)]
        return table


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
