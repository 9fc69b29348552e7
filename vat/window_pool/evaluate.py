"""`vat profile --perplexity-grid`: held-out perplexity of targets side by side under window-sharing constraints.

For every target (the base and its Window Pool continuation, or any others) and every held-out batch, one natural
forward and one forward per cell. A cell is a prefill-only constraint: the sequence is tiled into windows of W
positions and the tokens of each window share a set of d experts per MoE layer, chosen and applied by the MoE-Spec
budget hook itself (:class:`vat.target.BudgetSpec`, substitution on all MoE layers). The W x d_w grid is the
window-sharing constraint Window Pool trains for; the budget rows are the hard per-verification budget B over windows
of the verification block (W = K + 1). Per cell: perplexity (all tokens, and the data's loss-masked tokens), the KL to
the same target's natural next-token distribution (:func:`vat.eval.quality.kl_divergence`), top-1 agreement with it, the
mean executed union per window and layer, and the token-layers left with no natural expert in the set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from vat.config import DEFAULT_BUDGET_POLICY
from vat.errors import VatError
from vat.eval.quality import kl_divergence
from vat.target import BudgetSpec, contiguous_windows, load_target, window_union
from vat.train.data import collate
from vat.window_pool.data import heldout_sequences


@dataclass(frozen=True)
class Cell:
    """One constraint: windows of ``window`` positions sharing ``experts`` experts per MoE layer (None = natural)."""

    name: str
    window: int | None
    experts: int | None

    def spec(self, policy: str = DEFAULT_BUDGET_POLICY) -> BudgetSpec | None:
        if self.experts is None:
            return None
        return BudgetSpec(B=self.experts, policy=policy, window=self.window)


def grid_cells(windows: list[int], pools: list[int], budgets: list[int], verify_window: int) -> list[Cell]:
    """The natural cell, the W x d_w grid, then the budget rows at W = ``verify_window`` (duplicates kept once)."""
    cells = [Cell("natural", None, None)]
    seen = set()
    for w in windows:
        for d in pools:
            cells.append(Cell(f"W{w}_d{d}", w, d))
            seen.add((w, d))
    for b in budgets:
        if (verify_window, b) not in seen:
            cells.append(Cell(f"W{verify_window}_d{b}", verify_window, b))
    return cells


def evaluate_target(target, rows, cells: list[Cell], batch_size: int = 8, policy: str = DEFAULT_BUDGET_POLICY,
                    progress: bool = True) -> dict[str, dict]:
    """Perplexity and agreement of one target in every cell.

    Args:
        target: a :class:`~vat.target.FrozenTarget`.
        rows: :class:`vat.window_pool.data.TokenRows` (held-out sequences and their loss masks).
        cells: the constraints (the first must be the natural one).
        batch_size: sequences per forward (right-padded; padding is never budgeted nor counted).
        policy: budget policy of the constrained cells.
        progress: tqdm bar.

    Returns:
        ``{cell name: {"ppl", "masked_ppl", "kl", "agreement", "mean_union", "uncovered_fraction", "tokens",
        "window", "experts"}}``.
    """
    sums = {c.name: {"nll": 0.0, "nll_m": 0.0, "n": 0, "n_m": 0, "kl": 0.0, "agree": 0, "union": 0.0, "windows": 0,
                     "uncovered": 0, "token_layers": 0} for c in cells}
    pad = getattr(target.config, "pad_token_id", None)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))  # similar lengths together
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    num_moe = len(target.moe_layer_ids)
    for idx in tqdm(batches, desc="perplexity grid", disable=not progress):
        batch = collate([rows[i] for i in idx], int(pad) if pad is not None else 0)
        ids = batch["input_ids"].to(target.device)  # (B, T)
        attention = batch["attention_mask"].to(target.device)
        valid = attention.bool()
        target_ok = valid[:, 1:]  # (B, T-1): position t predicts token t+1
        masked_ok = target_ok & batch["loss_mask"].to(target.device).bool()[:, 1:]
        natural_logits = None
        for cell in cells:
            out = target.forward(ids, attention_mask=attention, budget=cell.spec(policy), output_aux=False)
            logits = out.logits[:, :-1].float()  # (B, T-1, V)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
            s = sums[cell.name]
            s["nll"] += float(nll[target_ok].sum())
            s["n"] += int(target_ok.sum())
            s["nll_m"] += float(nll[masked_ok].sum())
            s["n_m"] += int(masked_ok.sum())
            if natural_logits is None:
                natural_logits = logits
            s["kl"] += float(kl_divergence(logits, natural_logits)[target_ok].sum())
            s["agree"] += int((logits.argmax(-1) == natural_logits.argmax(-1))[target_ok].sum())
            window = cell.window or 8
            groups = out.window_groups
            n_groups = out.n_windows
            if groups is None:
                groups, n_groups = contiguous_windows(valid, window)
            union = window_union(out.topk_ids, groups, n_groups, target.num_experts)  # (L', G)
            real = torch.zeros(n_groups, dtype=torch.bool, device=union.device)
            real[groups[groups >= 0].unique()] = True  # window ids of padding-only windows do not count
            s["union"] += float(union[:, real].double().sum())
            s["windows"] += int(real.sum()) * num_moe
            if out.n_uncovered is not None:
                s["uncovered"] += int(out.n_uncovered.sum())
            s["token_layers"] += int(valid.sum()) * num_moe
    result = {}
    for cell in cells:
        s = sums[cell.name]
        result[cell.name] = {
            "window": cell.window, "experts": cell.experts,
            "ppl": math.exp(s["nll"] / max(s["n"], 1)),
            "masked_ppl": math.exp(s["nll_m"] / s["n_m"]) if s["n_m"] else None,
            "kl": s["kl"] / max(s["n"], 1),
            "agreement": s["agree"] / max(s["n"], 1),
            "mean_union": s["union"] / max(s["windows"], 1),
            "uncovered_fraction": s["uncovered"] / max(s["token_layers"], 1) if cell.experts is not None else None,
            "tokens": s["n"],
        }
    return result


def run_grid(targets: dict[str, str], data: str, windows: list[int], pools: list[int], budgets: list[int],
             verify_window: int, limit: int | None, max_length: int, batch_size: int, load_kwargs: dict,
             policy: str = DEFAULT_BUDGET_POLICY, progress: bool = True) -> dict:
    """Every target over the same held-out sequences and cells; the ``perplexity_grid.json`` dict."""
    cells = grid_cells(windows, pools, budgets, verify_window)
    out: dict = {"data": data, "limit": limit, "max_length": max_length, "policy": policy, "windows": windows,
                 "pools": pools, "budgets": budgets, "verify_window": verify_window, "targets": {}, "results": {}}
    rows = None
    for label, path in targets.items():
        start = time.time()
        target = load_target(path, **load_kwargs)
        try:
            if rows is None:
                rows = heldout_sequences(data, path, target.path or path, max_length, limit)
                out["sequences"] = len(rows)
            out["targets"][label] = {"path": path, "num_experts": target.num_experts, "top_k": target.top_k,
                                     "experts_impl": target.experts_impl}
            out["results"][label] = evaluate_target(target, rows, cells, batch_size, policy, progress)
            out["targets"][label]["seconds"] = round(time.time() - start, 1)
        finally:
            target.close()
    return out


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def markdown(result: dict) -> str:
    """The grid as Markdown: unconstrained perplexity, the W x d_w perplexity table (targets side by side, the ratio
    to the first target), and the budget table at W = K + 1 (perplexity, KL, agreement, union)."""
    labels = list(result["results"])
    first = labels[0]
    res = result["results"]
    lines = [f"# Held-out perplexity under window-sharing constraints ({result['data']}, {result['sequences']} "
             f"sequences, {res[first]['natural']['tokens']} tokens, policy {result['policy']})", "",
             "| target | unconstrained ppl | masked-token ppl |", "|---|---|---|"]
    for label in labels:
        nat = res[label]["natural"]
        ratio = f" ({nat['ppl'] / res[first]['natural']['ppl'] - 1:+.1%})" if label != first else ""
        lines.append(f"| {label} | {nat['ppl']:.2f}{ratio} | {_fmt(nat['masked_ppl'])} |")
    lines += ["", f"W x d_w grid: perplexity, {' / '.join(labels)}" + (f" (ratio {labels[1]} / {first})"
                                                                         if len(labels) > 1 else ""), ""]
    pools = result["pools"]
    lines.append("| W \\ d_w | " + " | ".join(str(d) for d in pools) + " |")
    lines.append("|---|" + "---|" * len(pools))
    for w in result["windows"]:
        row = []
        for d in pools:
            vals = [res[label][f"W{w}_d{d}"]["ppl"] for label in labels]
            text = " / ".join(f"{v:.2f}" for v in vals)
            if len(vals) > 1:
                text += f" ({vals[1] / vals[0]:.3f})"
            row.append(text)
        lines.append(f"| {w} | " + " | ".join(row) + " |")
    vw = result["verify_window"]
    lines += ["", f"Hard budget B per verification window (W = {vw}, substitution on all MoE layers)", "",
              "| B | target | ppl | KL to its natural | top-1 agreement | mean union | no natural expert in S |",
              "|---|---|---|---|---|---|---|"]
    for b in result["budgets"]:
        for label in labels:
            r = res[label][f"W{vw}_d{b}"]
            lines.append(f"| {b} | {label} | {r['ppl']:.2f} | {r['kl']:.4f} | {r['agreement']:.1%} | "
                         f"{r['mean_union']:.2f} | {_fmt(r['uncovered_fraction'] and 100 * r['uncovered_fraction'], 1)} % |")
    return "\n".join(lines) + "\n"


def _ints(text: str, key: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise VatError(f"--{key} must be a comma list of ints, got `{text}`") from None
    if not values or min(values) < 1:
        raise VatError(f"--{key} must list ints >= 1, got `{text}`")
    return values


def main(args: argparse.Namespace) -> int:
    """`vat profile --perplexity-grid` (setup -> run -> write)."""
    targets = {"base": args.target}
    for item in args.compare_target or []:
        label, _, path = item.rpartition("=")
        label = label or f"target{len(targets)}"
        if label in targets:
            raise VatError(f"--compare-target label `{label}` is used twice")
        targets[label] = path
    load_kwargs = {"dtype": args.dtype, "device": args.device, "experts_impl": args.experts_impl,
                   "device_map": args.device_map}
    result = run_grid(targets, args.data, _ints(args.windows, "windows"), _ints(args.pools, "pools"),
                      _ints(args.budgets, "budgets"), args.verify_window, args.limit, args.max_length,
                      args.batch_size, load_kwargs, args.policy)
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "perplexity_grid.json"), "w") as f:
        json.dump(result, f, indent=2)
    text = markdown(result)
    with open(os.path.join(args.output, "perplexity_grid.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {os.path.join(args.output, 'perplexity_grid.json')}")
    return 0
