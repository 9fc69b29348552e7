"""Budgeted target forwards of all six MoE families with ``experts_impl=triton`` against ``eager``.

For each family (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, GPT-OSS; tiny random models from
``tests/tiny_models.py``, 16 experts, top-4, no downloads) and each budget (natural, B = 2 < k, B = 6 between k and
the natural union; substitute and truncate), one ``FrozenTarget.forward`` through vat's loader with each experts
implementation on the same inputs. fp32 is strict (``--strict``: exit 1 unless every row has identical executed
expert ids and max |Δ logits| ≤ 1e-4); bf16 is reported (relative logits error, fraction of identical ids).

Usage::

    python benchmarks/kernel_parity.py --output parity.json --markdown parity.md        # on a GPU: fp32 + bf16
    python benchmarks/kernel_parity.py --cpu-smoke --families olmoe                   # Triton interpreter, fp32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["olmoe", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"]
BUDGETS = [(None, None), (2, "substitute"), (2, "truncate"), (6, "substitute"), (6, "truncate")]
FP32_ATOL = 1e-4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=48, help="tokens per sequence (one budget window)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--strict", action="store_true", help="exit 1 unless every fp32 row passes")
    p.add_argument("--output", default=None, help="JSON rows")
    p.add_argument("--markdown", default=None, help="Markdown table")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU through the Triton interpreter, fp32 only")
    return p.parse_args(argv)


def compare_family(family: str, dtype_name: str, device, tokens: int, batch: int) -> list[dict]:
    """One row per budget: the triton target's logits and executed ids against the eager target's."""
    import torch
    from tiny_models import tiny_model

    from vat.target import BudgetSpec, load_target

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 128, (batch, tokens), generator=gen).to(device)
    results = {}
    for impl in ("eager", "triton"):
        model = tiny_model(family, num_experts=16, top_k=4).to(device=device, dtype=dtype)
        target = load_target(model, device=device, experts_impl=impl)
        try:
            results[impl] = [
                target.forward(input_ids, budget=BudgetSpec(B=b, policy=p) if b else None, output_aux=False)
                for b, p in BUDGETS
            ]
        finally:
            target.close()
    rows = []
    for (budget, policy), eager, triton_out in zip(BUDGETS, results["eager"], results["triton"]):
        diff = (triton_out.logits.float() - eager.logits.float()).abs().max().item()
        scale = eager.logits.float().abs().max().item()
        same_ids = (triton_out.topk_ids == eager.topk_ids).float().mean().item()
        rows.append(
            dict(
                family=family, dtype=dtype_name, budget=budget, policy=policy, max_abs_diff=diff,
                rel_diff=diff / max(scale, 1e-30), ids_identical=same_ids,
                passed=(same_ids == 1.0 and diff <= FP32_ATOL) if dtype_name == "float32" else None,
            )
        )  # fmt: skip
    return rows


def error_row(family: str, dtype_name: str, err: BaseException) -> dict:
    return dict(family=family, dtype=dtype_name, budget=None, policy=None, error=f"{type(err).__name__}: {err}"[:300])


def format_markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| family | dtype | B | policy | max abs Δ logits | rel Δ | ids identical | fp32 strict |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['dtype']} | - | - | error: {r['error']} | | | FAIL |")
            continue
        verdict = {True: "pass", False: "FAIL", None: "(reported)"}[r["passed"]]
        lines.append(
            f"| {r['family']} | {r['dtype']} | {r['budget'] or 'none'} | {r['policy'] or '-'} | "
            f"{r['max_abs_diff']:.2e} | {r['rel_diff']:.2e} | {100 * r['ids_identical']:.1f} % | {verdict} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before vat.kernels.fused_moe is imported
        args.dtypes = ["float32"]
    sys.path.insert(0, os.path.join(REPO, "tests"))  # tiny_models
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("kernel_parity: no CUDA device (use --cpu-smoke for an interpreter run)")
        return 0
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    rows: list[dict] = []
    start = time.perf_counter()
    for dtype_name in args.dtypes:
        for family in args.families:
            try:
                rows += compare_family(family, dtype_name, device, args.tokens, args.batch)
            except Exception as err:  # one broken family must not hide the others' figures
                rows.append(error_row(family, dtype_name, err))
            print(format_markdown(rows[-1:], "").splitlines()[-1], flush=True)
    where = "cpu (Triton interpreter)" if args.cpu_smoke else torch.cuda.get_device_name()
    header = f"### Budgeted forwards, triton vs eager ({where}, {time.perf_counter() - start:.0f} s)"
    table = format_markdown(rows, header)
    print("\n" + table)
    strict_rows = [r for r in rows if r["dtype"] == "float32"]
    ok = all(r.get("passed") is True for r in strict_rows)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(
                dict(device=where, torch=torch.__version__, fp32_atol=FP32_ATOL, fp32_ok=ok, rows=rows), f, indent=2
            )
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.strict and not ok:
        print("kernel_parity: fp32 parity FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
