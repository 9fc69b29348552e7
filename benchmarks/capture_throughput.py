"""Training from a capture vs online, side by side: disk and seconds per 1,000 tokens to capture (`vat prep capture`)
and to read the capture back, then one training step (batch read + target forward or capture read + draft forward
+ backward + AdamW) online and from the capture, on the same batches, with the target bytes each holds.

    python benchmarks/capture_throughput.py [--target tiny-quick] [--data tiny] [--limit 200] [--repeats 6]

The capture is taken fresh into ``--workdir`` (fp32 on CPU: the target's dtype), over the first ``--limit`` rows of
the training data; the steps are the VAT recipe with the union term on (``method=vat``, ``loss.union_weight=0.05``),
timed round-robin over the same ``--repeats`` batches after one warm-up step each; medians are reported. Writes JSON
with ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch

from vat.config import load_config
from vat.data_prep.capture import capture
from vat.data_prep.capture_store import CaptureReader
from vat.train.defaults import resolve_train_data
from vat.train.trainer import Trainer

RECIPE = ["method=vat", "loss.union_weight=0.05", "logging.progress=false", "data.shuffle=false"]


def timed_capture(args, data: str, out: str) -> dict:
    """A fresh capture of the first ``--limit`` rows; its disk and seconds per 1,000 tokens (the whole command)."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = capture(args.target, data, out, limit=args.limit, max_length=args.max_length, progress=False)
    seconds = time.perf_counter() - start
    tokens = manifest["tokens"]
    return {"rows": len(manifest["rows"]), "tokens": tokens, "shards": len(manifest["shards"]),
            "mib_per_1k_tokens": manifest["bytes"] / tokens * 1000 / 2**20,
            "forward_write_s_per_1k_tokens": manifest["seconds"] / tokens * 1000,
            "command_s_per_1k_tokens": seconds / tokens * 1000, "dtype": manifest["dtype"]}


def timed_read(out: str) -> dict:
    """Seconds per 1,000 tokens to read every captured row back (fresh reader, memory-mapped shards)."""
    reader = CaptureReader(out)
    start = time.perf_counter()
    tokens = sum(reader.sample(row)["input_ids"].shape[0] for row in reader.manifest["rows"])
    return {"read_s_per_1k_tokens": (time.perf_counter() - start) / tokens * 1000}


def build(args, data: str, capture_dir: str | None) -> Trainer:
    extra = [f"data.capture={capture_dir}"] if capture_dir else []
    cfg = load_config(None, [f"target.path={args.target}", f"data.train={data}", f"data.limit={args.limit}",
                             f"data.max_length={args.max_length}", f"data.tokens_per_batch={args.tokens}",
                             f"output_dir={args.workdir}/{'capture' if capture_dir else 'online'}", *RECIPE, *extra])
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer


def one_step(trainer: Trainer) -> dict[str, float]:
    """The next batch read (and, from a capture, its features) + one optimizer step: its seconds; then, untimed by
    the step, the seconds of the target's part alone (online: the frozen forward; capture: LM head(final norm))."""
    start = time.perf_counter()
    _, batch = trainer.next_batch()
    read = time.perf_counter()
    loss, _ = trainer.forward_loss(batch, trainer.step_context(trainer.step))
    trainer.accelerator.backward(loss)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.after_step()
    done = time.perf_counter()
    trainer._target_forward(batch, None)
    return {"step_s": done - start, "batch_s": read - start, "target_s": time.perf_counter() - done,
            "tokens": int(batch["attention_mask"].sum())}


def target_bytes(trainer: Trainer) -> int:
    """Bytes of target weights the run holds (the whole model online; embedding, norm and LM head from a capture)."""
    target = trainer.target
    if hasattr(target, "model"):
        return sum(p.numel() * p.element_size() for p in target.model.parameters())
    modules = (target.embed_tokens(), target.final_norm(), target.lm_head())
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny-quick")
    parser.add_argument("--data", default="tiny", help="prepared dataset (tiny: the embedded target's)")
    parser.add_argument("--limit", type=int, default=200, help="rows captured and trained on")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per training batch")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--workdir", default="outputs/capture_throughput")
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = resolve_train_data(args.data, args.target, args.max_length)
    out = os.path.join(args.workdir, "capture")
    result = {"target": args.target, "data": data, "capture": timed_capture(args, data, out)}
    result["capture"].update(timed_read(out))
    trainers = {"online": build(args, data, None), "capture": build(args, data, out)}
    for trainer in trainers.values():
        one_step(trainer)  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in trainers}
    for _ in range(args.repeats):
        for name, trainer in trainers.items():  # the same batch for both: the same seed, data and position
            runs[name].append(one_step(trainer))
    assert [r["tokens"] for r in runs["online"]] == [r["tokens"] for r in runs["capture"]]  # the same batches
    result["step"] = {name: {**{f"median_{k}": statistics.median(r[k] for r in v) for k in ("step_s", "batch_s",
                                                                                           "target_s")},
                             "tokens": [r["tokens"] for r in v], "target_mib": target_bytes(trainers[name]) / 2**20}
                      for name, v in runs.items()}
    for trainer in trainers.values():
        trainer.close()
    c = result["capture"]
    print(f"capture of {c['rows']} rows, {c['tokens']} tokens ({c['dtype']}, {c['shards']} shard(s)): "
          f"{c['mib_per_1k_tokens']:.2f} MiB, {c['command_s_per_1k_tokens']:.3f} s (command; "
          f"{c['forward_write_s_per_1k_tokens']:.3f} s forward + write) and {c['read_s_per_1k_tokens']:.4f} s to read, "
          "per 1,000 tokens")
    print(f"{'step':<10} {'s/step':>8} {'batch s':>8} {'target s':>9} {'target MiB':>11}")
    for name, s in result["step"].items():
        print(f"{name:<10} {s['median_step_s']:>8.4f} {s['median_batch_s']:>8.4f} {s['median_target_s']:>9.4f} "
              f"{s['target_mib']:>11.2f}")
    step = result["step"]
    print(f"ratio capture/online: {step['capture']['median_step_s'] / step['online']['median_step_s']:.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
