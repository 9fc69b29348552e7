"""Budgeted fused-MoE kernel vs transformers' ``eager`` and ``grouped_mm`` experts forwards, at verification shapes.

For each model's expert dims (OLMoE-1B-7B, Qwen3-30B-A3B), each verification-block size T and each expert budget B:
random router logits -> routing (natural, or MoE-Spec budgeted: the window's top-B experts by summed softmax mass,
top-k rerun inside that set, weights = the unmasked probabilities, renormalised if the model does) -> one experts
forward through vat's Triton kernel and through a real HF experts module (``OlmoeExperts`` / ``Qwen3MoeExperts``) with
``config._experts_implementation`` set to ``eager`` and to ``grouped_mm``, all on the same inputs in the same run.

Reported per row: median time per forward (CUDA events, after warm-up, L2 flushed before every timed call), experts
read and their weight bytes, achieved HBM bandwidth — (expert weight bytes read + activation bytes, i.e. the input
``(T, H)`` read and the output ``(T, H)`` written) / time — and its fraction of the device's peak (from
:data:`PEAK_GBPS` by device name, or ``--peak-gbps``; unknown devices print n/a), and the time ratios
eager / triton and grouped_mm / triton (> 1 = the kernel is faster). Two timings per implementation where possible:
plain launches (what a HF forward pays, CPU launch overhead included) and CUDA-graph replay (GPU time only; the
kernel path has no host sync, so it captures; ``eager`` syncs and is never captured). GB/s and % peak use the graph
time when there is one. Prints a Markdown table; ``--output`` writes JSON, ``--markdown`` the table.

Usage::

    python benchmarks/moe_kernel.py --output moe_kernel.json              # on a GPU (peak from the device name)
    python benchmarks/moe_kernel.py --peak-gbps 3350 --tokens 8 32        # explicit peak, fewer shapes
    python benchmarks/moe_kernel.py --cpu-smoke                           # tiny shapes, Triton interpreter, CPU

Without a GPU (and without ``--cpu-smoke``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

MODELS = {
    "olmoe-1b-7b": dict(family="olmoe", hidden=2048, intermediate=1024, num_experts=64, top_k=8, norm_topk_prob=False),
    "qwen3-30b-a3b": dict(
        family="qwen3_moe", hidden=2048, intermediate=768, num_experts=128, top_k=8, norm_topk_prob=True
    ),
}
SMOKE_MODELS = {
    "tiny-olmoe": dict(family="olmoe", hidden=64, intermediate=32, num_experts=16, top_k=4, norm_topk_prob=False),
    "tiny-qwen3": dict(family="qwen3_moe", hidden=64, intermediate=48, num_experts=32, top_k=4, norm_topk_prob=True),
}
IMPLS = ("eager", "grouped_mm")
PEAK_GBPS = [  # (substrings of torch.cuda.get_device_name(), all required; peak HBM GB/s), first match wins
    (("H200",), 4800.0),
    (("H100", "PCIe"), 2000.0),
    (("H100", "NVL"), 3900.0),
    (("H100",), 3350.0),  # SXM (HBM3) — reported as "NVIDIA H100 80GB HBM3"
    (("A100",), 2000.0),
]


def peak_gbps_for(device_name: str) -> float | None:
    """Peak memory bandwidth of a known device from its name (None if unknown)."""
    for needles, gbps in PEAK_GBPS:
        if all(n in device_name for n in needles):
            return gbps
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=None, help=f"subset of {', '.join(MODELS)}")
    p.add_argument("--tokens", nargs="+", type=int, default=[8, 16, 32, 64], help="verification-block sizes T")
    p.add_argument(
        "--budgets", nargs="+", default=["none", "32", "16", "8"], help="expert budgets B ('none' = natural)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--peak-gbps", type=float, default=None, help="device peak memory bandwidth in GB/s (default: by device name)"
    )
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per implementation (includes autotuning)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per implementation (median reported)")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the rows as JSON here")
    p.add_argument("--markdown", default=None, help="write the Markdown table here")
    p.add_argument(
        "--cpu-smoke", "--dry-run", action="store_true", help="tiny shapes on CPU through the Triton interpreter"
    )
    return p.parse_args(argv)


def build_experts(spec: dict, dtype, device, seed: int):
    """A real transformers experts module with the model's expert dims and random weights."""
    import torch
    from transformers import OlmoeConfig, Qwen3MoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(seed)
    common = dict(hidden_size=spec["hidden"], num_experts=spec["num_experts"], num_experts_per_tok=spec["top_k"])
    if spec["family"] == "olmoe":
        config = OlmoeConfig(**common, intermediate_size=spec["intermediate"])
        module = OlmoeExperts(config)
    else:
        config = Qwen3MoeConfig(**common, moe_intermediate_size=spec["intermediate"])
        module = Qwen3MoeExperts(config)
    config._experts_implementation = "eager"
    module = module.to(device=device, dtype=dtype).requires_grad_(False).eval()
    with torch.no_grad():
        module.gate_up_proj.normal_(0.0, spec["hidden"] ** -0.5)
        module.down_proj.normal_(0.0, spec["intermediate"] ** -0.5)
    return module


def make_routing(logits, top_k: int, norm_topk_prob: bool, budget: int | None):
    """``(topk_ids (T, k), topk_weights (T, k) fp32)``: natural, or budgeted by substitution inside the top-B set."""
    import torch

    probs = logits.float().softmax(-1)  # (T, E)
    natural_union = probs.topk(top_k, dim=-1).indices.unique().numel()
    if budget is None or budget >= natural_union:  # the union fits: routing stays natural
        ranking = probs
    else:
        allowed = probs.sum(0).topk(budget).indices  # (B,) window's top-B experts by summed mass
        inside = torch.zeros_like(probs, dtype=torch.bool)
        inside[:, allowed] = True
        ranking = probs.masked_fill(~inside, -1.0)  # exclude out-of-budget experts from the ranking only
    ids = ranking.topk(top_k, dim=-1).indices  # (T, k)
    weights = probs.gather(-1, ids)  # (T, k) unmasked probabilities
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def make_timer(device, warmup: int, iters: int, flush: bool) -> Callable[[Callable[[], object]], float]:
    """A function timing ``fn`` (median seconds over ``iters`` calls after ``warmup``)."""
    import torch

    if device.type != "cuda":

        def time_cpu(fn):
            for _ in range(warmup):
                fn()
            samples = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)

        return time_cpu

    scratch = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if flush else None  # > any GPU's L2

    def time_cuda(fn):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            if scratch is not None:
                scratch.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3

    return time_cuda


def graph_timer(fn: Callable[[], object], timer) -> float | None:
    """Median seconds of a CUDA-graph replay of ``fn``, or None if ``fn`` cannot be captured."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as err:
        print(f"  (not graph-capturable: {str(err).splitlines()[0][:100]})", file=sys.stderr)
        torch.cuda.synchronize()
        return None
    return timer(graph.replay)


def bench_one(module, x, ids, weights, timer, graphs: bool) -> dict:
    """Time one routing through the kernel and through the HF module's eager and grouped_mm forwards."""
    import torch

    from vat.kernels.fused_moe import fused_experts, record_experts_read

    run_triton = functools.partial(fused_experts, x, module.gate_up_proj, module.down_proj, ids, weights)
    run_hf = functools.partial(module, x, ids, weights)
    result: dict = {}
    with torch.no_grad():
        with record_experts_read() as calls:
            out = run_triton()
        result["experts_read"] = len(calls[0].experts)
        result["triton_s"] = timer(run_triton)
        result["triton_graph_s"] = graph_timer(run_triton, timer) if graphs else None
        for impl in IMPLS:
            module.config._experts_implementation = impl
            result[f"{impl}_s"] = timer(run_hf)
        module.config._experts_implementation = "grouped_mm"
        result["grouped_mm_graph_s"] = graph_timer(run_hf, timer) if graphs else None
        module.config._experts_implementation = "eager"
        expected = run_hf().float()
    err = (out.float() - expected).abs().max().item()
    result.update(max_abs_err=err, rel_err=err / max(expected.abs().max().item(), 1e-30))
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None else None


def _us(t: float | None) -> float | None:
    return t * 1e6 if t is not None else None


def bench(args: argparse.Namespace) -> list[dict]:
    import torch

    from vat.kernels.fused_moe import expert_bytes

    device = torch.device("cuda" if not args.cpu_smoke else "cpu")
    dtype = getattr(torch, args.dtype) if not args.cpu_smoke else torch.float32
    models = SMOKE_MODELS if args.cpu_smoke else MODELS
    names = args.models or list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}: choose from {list(models)}")
    budgets = [None if str(b).lower() == "none" else int(b) for b in args.budgets]
    timer = make_timer(device, args.warmup, args.iters, flush=not args.no_flush and device.type == "cuda")
    rows = []
    for name in names:
        spec = models[name]
        module = build_experts(spec, dtype, device, args.seed)
        per_expert = expert_bytes(module.gate_up_proj, module.down_proj)
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        for tokens in args.tokens:
            x = torch.randn(tokens, spec["hidden"], generator=gen).to(device=device, dtype=dtype)  # (T, H)
            logits = torch.randn(tokens, spec["num_experts"], generator=gen).to(device)  # (T, E) router logits
            natural_ids, _ = make_routing(logits, spec["top_k"], spec["norm_topk_prob"], None)
            union = int(natural_ids.unique().numel())
            for budget in budgets:
                if budget is not None and budget < spec["top_k"]:
                    print(f"skip B={budget} < top_k={spec['top_k']} for {name}", file=sys.stderr)
                    continue
                ids, weights = make_routing(logits, spec["top_k"], spec["norm_topk_prob"], budget)
                weights = weights.to(dtype)  # HF routers hand the experts weights in the model dtype
                r = bench_one(module, x, ids, weights, timer, graphs=device.type == "cuda" and not args.no_graphs)
                bytes_read = r["experts_read"] * per_expert
                bytes_moved = bytes_read + 2 * x.numel() * x.element_size()  # + input read and output written
                gpu_s = r["triton_graph_s"] or r["triton_s"]
                gbps = bytes_moved / gpu_s / 1e9
                rows.append(
                    dict(
                        model=name, tokens=tokens, budget=budget, natural_union=union,
                        experts_read=r["experts_read"], bytes_read=bytes_read, bytes_moved=bytes_moved,
                        triton_us=_us(r["triton_s"]), triton_graph_us=_us(r["triton_graph_s"]),
                        eager_us=_us(r["eager_s"]), grouped_mm_us=_us(r["grouped_mm_s"]),
                        grouped_mm_graph_us=_us(r["grouped_mm_graph_s"]),
                        triton_gbps=gbps, frac_peak=gbps / args.peak_gbps if args.peak_gbps else None,
                        gbps_from="graph" if r["triton_graph_s"] else "launch",
                        eager_over_triton=_ratio(r["eager_s"], r["triton_s"]),
                        grouped_mm_over_triton=_ratio(r["grouped_mm_s"], r["triton_s"]),
                        grouped_mm_over_triton_graph=_ratio(r["grouped_mm_graph_s"], r["triton_graph_s"]),
                        max_abs_err_vs_eager=r["max_abs_err"], rel_err_vs_eager=r["rel_err"],
                    )
                )  # fmt: skip
                print(format_row(rows[-1]), file=sys.stderr, flush=True)
    return rows


COLUMNS = [  # (header, row key, format)
    ("model", "model", "{}"), ("T", "tokens", "{}"), ("B", "budget", "{}"), ("union", "natural_union", "{}"),
    ("experts read", "experts_read", "{}"), ("MB read", "bytes_read", "mb"),
    ("triton µs", "triton_us", "{:.1f}"), ("triton graph µs", "triton_graph_us", "{:.1f}"),
    ("GB/s", "triton_gbps", "{:.0f}"), ("% peak", "frac_peak", "pct"),
    ("eager µs", "eager_us", "{:.1f}"), ("grouped_mm µs", "grouped_mm_us", "{:.1f}"),
    ("grouped_mm graph µs", "grouped_mm_graph_us", "{:.1f}"),
    ("eager/triton", "eager_over_triton", "{:.2f}"), ("grouped_mm/triton", "grouped_mm_over_triton", "{:.2f}"),
    ("grouped_mm/triton (graph)", "grouped_mm_over_triton_graph", "{:.2f}"), ("rel err", "rel_err_vs_eager", "{:.1e}"),
]  # fmt: skip


def _cell(value, fmt: str) -> str:
    if value is None:
        return "none" if fmt == "{}" else "n/a" if fmt == "pct" else "-"
    if fmt == "mb":
        return f"{value / 1e6:.1f}"
    if fmt == "pct":
        return f"{100 * value:.1f}"
    return fmt.format(value)


def format_row(r: dict) -> str:
    return "| " + " | ".join(_cell(r[key], fmt) for _, key, fmt in COLUMNS) + " |"


def format_table(rows: list[dict]) -> str:
    header = "| " + " | ".join(h for h, _, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    return "\n".join([header, sep] + [format_row(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before vat.kernels.fused_moe is imported
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("moe_kernel benchmark: no CUDA device, nothing to measure (use --cpu-smoke for an interpreter run)")
        return 0
    if args.cpu_smoke:
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 2)
        if args.tokens == [8, 16, 32, 64]:
            args.tokens = [4, 8]
        if args.budgets == ["none", "32", "16", "8"]:
            args.budgets = ["none", "8", "4"]
    device = "cpu (Triton interpreter)" if args.cpu_smoke else torch.cuda.get_device_name()
    if args.peak_gbps is None and not args.cpu_smoke:
        args.peak_gbps = peak_gbps_for(device)
    rows = bench(args)
    dtype = "float32" if args.cpu_smoke else args.dtype
    flushed = not args.no_flush and not args.cpu_smoke
    peak = f"{args.peak_gbps:.0f} GB/s" if args.peak_gbps else "n/a (unknown device: pass --peak-gbps)"
    title = (f"fused-MoE experts forward, {device}, {dtype}, HBM peak {peak}, median of {args.iters} "
             f"(L2 flushed: {flushed}); GB/s = (expert bytes read + input/output activations) / triton time")  # fmt: skip
    table = format_table(rows)
    print(f"\n{title}\n")
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"### {title}\n\n{table}\n")
    if args.output:
        meta = dict(
            device=device, dtype=dtype, peak_gbps=args.peak_gbps, warmup=args.warmup, iters=args.iters,
            l2_flushed=flushed, cuda_graphs=not args.no_graphs and not args.cpu_smoke, torch=torch.__version__,
            seed=args.seed,
        )  # fmt: skip
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
