"""`vat profile`: how badly a target scatters experts per verification window, and what a budget costs.

Runs the target over benchmark prompts, tiles each prompt into windows of W consecutive positions (the size of a
verification block), and measures per MoE layer the union of experts each window loads, the expert bytes that
union weighs, and — with ``--budget`` — the KL of the budgeted next-token distribution to the unbudgeted one and the
share of tokens none of whose natural experts is in the budget set (``uncovered_fraction``). The target is loaded as
the trainer loads it (``--experts-impl``, ``--dtype``, ``--device``, ``--device-map``); profile.json records the
experts implementation and the wall time of the natural and budgeted forwards.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from vat.config import DEFAULT_BUDGET_POLICY
from vat.errors import VatError
from vat.eval.benchmarks import load_benchmark
from vat.eval.cost import CostModel, get_accelerator, target_shape
from vat.eval.prompts import render_chat
from vat.eval.quality import kl_divergence
from vat.eval.target_quality import write_quality
from vat.eval.verify_cost import build_verify_cost, own_texts
from vat.target import BudgetSpec, bytes_per_window, contiguous_windows, load_target, window_union
from vat.window_pool.evaluate import main as grid_main


def parse_budget(text: str | None) -> int | list[int] | None:
    """``"8"`` -> 8; ``"8,4,4"`` -> one budget per MoE layer; None/``none`` -> None."""
    if text is None or str(text).lower() == "none":
        return None
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise VatError(f"--budget must be an int or a comma list of ints, got `{text}`") from None
    return values[0] if len(values) == 1 else values


def profile_target(target, prompts_ids: list[list[int]], window: int, budget=None, policy: str = DEFAULT_BUDGET_POLICY,
                   progress: bool = True) -> dict:
    """Measure expert unions per window (natural and budgeted) over token sequences.

    Args:
        target: a :class:`~vat.target.FrozenTarget`.
        prompts_ids: token id lists, one per prompt.
        window: W, positions per window.
        budget: None, an int, or a per-MoE-layer list.
        policy: budget policy.
        progress: show a progress bar.

    Returns:
        The ``profile.json`` dict (see :func:`main`).
    """
    num_moe = len(target.moe_layer_ids)
    bytes_per_layer = target.expert_bytes_per_layer()
    spec = BudgetSpec(B=budget, policy=policy, window=window) if budget is not None else None
    unions, nat_unions, window_bytes, kls, uncovered = [], [], [], [], []
    n_tokens = 0
    seconds = {"natural": 0.0, "budgeted": 0.0}
    for ids in tqdm(prompts_ids, desc=f"profile W={window}", disable=not progress):
        input_ids = torch.tensor([ids], device=target.device)  # (1, T)
        valid = torch.ones_like(input_ids, dtype=torch.bool)
        natural = _timed(seconds, "natural", target, input_ids)
        groups, n_groups = contiguous_windows(valid, window)
        nat = window_union(natural.topk_ids, groups, n_groups, target.num_experts)  # (L', G)
        nat_unions.append(nat)
        used = nat
        if spec is not None:
            budgeted = _timed(seconds, "budgeted", target, input_ids, spec)
            used = window_union(budgeted.topk_ids, budgeted.window_groups, budgeted.n_windows, target.num_experts)
            kls.append(kl_divergence(budgeted.logits[0], natural.logits[0]))  # (T,)
            uncovered.append(budgeted.n_uncovered.sum())  # every token of the prompt is budgeted here
        unions.append(used)
        window_bytes.append(bytes_per_window(used, bytes_per_layer))
        n_tokens += len(ids)
    if not unions:
        raise VatError("no prompts to profile")
    union = torch.cat(unions, dim=1).double()  # (L', total windows)
    natural_union = torch.cat(nat_unions, dim=1).double()
    result = {
        "num_layers": target.num_layers,
        "num_moe_layers": num_moe,
        "moe_layer_ids": target.moe_layer_ids,
        "num_experts": target.num_experts,
        "top_k": target.top_k,
        "window": window,
        "budget": budget,
        "policy": policy if budget is not None else None,
        "n_prompts": len(prompts_ids),
        "n_tokens": n_tokens,
        "n_windows": int(union.shape[1]),
        "mean_union": float(union.mean()),
        "union_by_layer": [float(u) for u in union.mean(dim=1)],
        "max_union": int(union.max()),
        "natural_mean_union": float(natural_union.mean()),
        "natural_max_union": int(natural_union.max()),
        "expert_bytes_per_layer": bytes_per_layer,
        "expert_bytes_per_window": float(torch.cat(window_bytes).mean()),
        "kl_to_unbudgeted": float(torch.cat(kls).mean()) if kls else None,
        # tokens x layers with no natural expert in the budget set (truncate: no expert output), over all tokens
        "uncovered_fraction": float(torch.stack(uncovered).sum()) / (num_moe * n_tokens) if uncovered else None,
        "experts_impl": target.experts_impl,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device),
        "natural_forward_seconds": round(seconds["natural"], 4),
        "budgeted_forward_seconds": round(seconds["budgeted"], 4) if spec is not None else None,
    }
    return result


def _timed(seconds: dict, key: str, target, input_ids: torch.Tensor, spec: BudgetSpec | None = None):
    """One target forward, its wall time (device work included) added to ``seconds[key]``."""
    _sync(target.device)
    start = time.perf_counter()
    out = target.forward(input_ids, budget=spec, output_aux=False)
    _sync(target.device)
    seconds[key] += time.perf_counter() - start
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(args: argparse.Namespace) -> int:
    """Entry point of `vat profile` (setup -> run -> write)."""
    if getattr(args, "perplexity_grid", False):  # Window Pool's held-out perplexity grid (vat/window_pool)
        return grid_main(args)
    if getattr(args, "quality", False):
        return quality_main(args)
    if args.benchmark is None:
        raise VatError("vat profile needs --benchmark (or --perplexity-grid, --quality)")
    if args.window < 1:
        raise VatError("--window must be >= 1")
    budget = parse_budget(args.budget)
    start = time.time()
    target = load_target(
        args.target, dtype=getattr(args, "dtype", "auto"), device=getattr(args, "device", None),
        experts_impl=getattr(args, "experts_impl", "grouped_mm"), device_map=getattr(args, "device_map", None),
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(target.path or args.target)
    except OSError as err:
        raise VatError(f"cannot load the target's tokenizer from {args.target}: {str(err).splitlines()[0]}") from None
    prompts = load_benchmark(args.benchmark, limit=args.limit)
    prompts_ids = [render_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])[: args.max_length] for p in prompts]
    result = profile_target(target, prompts_ids, args.window, budget, args.policy)
    widths = getattr(args, "verify_widths", None)
    if widths:
        new_tokens = getattr(args, "new_tokens", None) or 64
        result["verify_cost"] = verify_cost_profile(target, prompts_ids, widths, new_tokens,
                                                    getattr(args, "cost_model", None) or "h200")
    result.update({"target": args.target, "benchmark": args.benchmark, "seconds": round(time.time() - start, 2)})
    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "profile.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.output, "profile.md"), "w") as f:
        f.write(_markdown(result))
    print(_markdown(result))
    print(f"wrote {path}")
    return 0


def quality_main(args: argparse.Namespace) -> int:
    """`vat profile --quality`: the target-quality table (:mod:`vat.eval.target_quality`) -> DIR/quality.{json,md}."""
    text = write_quality(
        args.target, args.output, benchmarks=[args.benchmark] if args.benchmark else ("spec_bench", "humaneval"),
        limit=args.limit or 40, max_new_tokens=getattr(args, "new_tokens", None) or 96, window=args.window,
        dtype=getattr(args, "dtype", "auto"), device=getattr(args, "device", None),
        experts_impl=getattr(args, "experts_impl", "grouped_mm"), device_map=getattr(args, "device_map", None),
    )
    print(text)
    print(f"wrote {os.path.join(args.output, 'quality.json')}")
    return 0


def verify_cost_profile(target, prompts_ids: list[list[int]], widths: str, new_tokens: int, accelerator: str) -> dict:
    """EVICT's verification-cost table (:mod:`vat.eval.verify_cost`): the mean expert union of w consecutive positions
    of the target's own greedy answers to the prompts, the modeled verification time on ``accelerator`` and the
    measured wall time of a w-token forward on this device, per width w in ``widths`` (``"1,2,4,8"``)."""
    try:
        values = [int(w) for w in str(widths).split(",") if w.strip()]
    except ValueError:
        raise VatError(f"--verify-widths takes a comma list of integers, got `{widths}`") from None
    model = CostModel(get_accelerator(accelerator), target_shape(target))
    texts = own_texts(target, prompts_ids, new_tokens)
    table = build_verify_cost(target, texts, values, cost=model, measure=True,
                              source=f"vat profile: the target's greedy answers ({new_tokens} tokens) to {len(texts)} "
                              "prompts")
    return table.to_dict()


def _markdown(r: dict) -> str:
    lines = [
        f"# Expert scattering of {r.get('target', 'the target')} (window W={r['window']})",
        "",
        "| metric | value |",
        "|---|---|",
        f"| MoE layers x experts (top-k) | {r['num_moe_layers']} x {r['num_experts']} (top-{r['top_k']}) |",
        f"| experts implementation / dtype / device | {r['experts_impl']} / {r['dtype']} / {r['device']} |",
        f"| prompts / tokens / windows | {r['n_prompts']} / {r['n_tokens']} / {r['n_windows']} |",
        f"| natural mean union per layer per window | {r['natural_mean_union']:.2f} (max {r['natural_max_union']}) |",
    ]
    if r["budget"] is not None:
        lines += [
            f"| budget B ({r['policy']}) | {r['budget']} |",
            f"| budgeted mean union | {r['mean_union']:.2f} (max {r['max_union']}) |",
            f"| KL(budgeted ‖ unbudgeted) per token | {r['kl_to_unbudgeted']:.5f} nats |",
            f"| tokens x layers with no natural expert in the budget | {r['uncovered_fraction']:.2%} |",
            f"| forward wall time natural / budgeted | {r['natural_forward_seconds']:.3f} s / "
            f"{r['budgeted_forward_seconds']:.3f} s |",
        ]
    lines.append(f"| expert bytes per window | {r['expert_bytes_per_window'] / 2**20:.2f} MiB |")
    lines.append("")
    lines.append("Union by MoE layer: " + ", ".join(f"{u:.2f}" for u in r["union_by_layer"]))
    vc = r.get("verify_cost")
    if vc:
        lines += ["", f"## Verification cost against width (EVICT's profile; modeled on {vc['accelerator']}, context "
                  f"{vc['context']:.0f})", "", "| verified tokens | mean union per layer | modeled ms | measured ms "
                  f"({vc['device']}) |", "|---|---|---|---|"]
        for w, u, m, t in zip(vc["widths"], vc["union"], vc["modeled_seconds"], vc["measured_seconds"]):
            lines.append(f"| {w} | {sum(u) / len(u):.2f} | {1e3 * m:.4f} | {1e3 * t:.2f} |")
    return "\n".join(lines) + "\n"
