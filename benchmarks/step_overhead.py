"""Seconds per training step of EAGLE-3 vs VAT on the same batch, model and process; prints the ratios.

    python benchmarks/step_overhead.py [--target tiny] [--data tiny] [--repeats 20] [--output results.json]
    python benchmarks/step_overhead.py --variants eagle3,eagle3-autograd,vat,vat-autograd   # chunked vs autograd CE

Each variant is a full optimizer step (frozen target forward with capture, TTT unroll, objective, backward, clip,
AdamW): ``eagle3`` (baseline), ``vat`` (simulated verification + adaptive weights + VH), ``vat+union`` (plus the
expert-union penalty), ``vat+union+budget`` (plus the windowed expert budget on the target forward); ``*-autograd``
are the same steps with the imitation loss through autograd (``loss.imitation_chunk_mb=null``) instead of the
chunked path (``vat/imitation.py``, the default). Variants are timed round-robin so machine noise hits them alike;
the median is reported. The last line is ``ratio vat/eagle3: X.XX`` (goal: <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

VARIANTS = {
    "eagle3": ["method=eagle3"],
    "vat": ["method=vat"],
    "vat+union": ["method=vat", "loss.union_weight=0.05"],
    "vat+union+budget": ["method=vat", "loss.union_weight=0.05", "budget.B=4"],
    "eagle3-autograd": ["method=eagle3", "loss.imitation_chunk_mb=null"],
    "vat-autograd": ["method=vat", "loss.imitation_chunk_mb=null"],
}
DEFAULT_VARIANTS = "eagle3,vat,vat+union,vat+union+budget"


def build(variant: list[str], args) -> object:
    from vat.config import load_config
    from vat.train.trainer import Trainer

    cfg = load_config(args.recipe, [
        f"target.path={args.target}", f"data.train={args.data}", f"output_dir={args.workdir}",
        f"data.tokens_per_batch={args.tokens}", "logging.progress=false", "data.shuffle=false", *variant,
    ])
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer


def one_step(trainer, batch) -> float:
    """One full optimizer step; returns seconds."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss, _ = trainer.forward_loss(batch, trainer.step_context(trainer.step))
    trainer.accelerator.backward(loss)
    trainer.accelerator.clip_grad_norm_(trainer.drafter.parameters(), trainer.cfg.train.grad_clip)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=None, help="base recipe (default: the built-in defaults)")
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--data", default="tiny")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workdir", default="outputs/step_overhead")
    parser.add_argument("--output", default=None, help="write the timings as JSON")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma list of {', '.join(VARIANTS)} (eagle3 always runs: the ratios' base)")
    args = parser.parse_args()
    names = ["eagle3", *[n for n in args.variants.split(",") if n and n != "eagle3"]]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; one of {', '.join(VARIANTS)}")

    from vat.train.data import collate

    trainers = {name: build(VARIANTS[name], args) for name in names}
    first = trainers["eagle3"]
    indices = first.batches.epoch(0)[0]
    batch = {k: v.to(first.device) for k, v in collate([first.dataset[i] for i in indices], first.pad_id).items()}
    for trainer in trainers.values():
        for _ in range(args.warmup):
            one_step(trainer, batch)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.repeats):
        for name, trainer in trainers.items():
            times[name].append(one_step(trainer, batch))
    base = statistics.median(times["eagle3"])
    tokens = int(batch["attention_mask"].sum())
    print(f"batch: {tuple(batch['input_ids'].shape)} ({tokens} tokens), device {first.device}, "
          f"{args.repeats} repeats, median seconds per optimizer step")
    print(f"{'variant':<20} {'s/step':>9} {'ratio':>7}")
    result = {"batch_shape": list(batch["input_ids"].shape), "tokens": tokens, "device": str(first.device), "steps": {}}
    for name, values in times.items():
        med = statistics.median(values)
        result["steps"][name] = {"median_s": med, "ratio": med / base, "all_s": values}
        print(f"{name:<20} {med:>9.4f} {med / base:>7.2f}")
    for trainer in trainers.values():
        trainer.close()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    if "vat" in times:
        print(f"ratio vat/eagle3: {statistics.median(times['vat']) / base:.2f}")


if __name__ == "__main__":
    main()
