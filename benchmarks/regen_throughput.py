"""Throughput of `vat prep regen`, the old code path and the new one side by side on the same conversations.

    python benchmarks/regen_throughput.py                        # 128 ShareGPT conversations, 2 turns, 96 new tokens
    python benchmarks/regen_throughput.py --n 64 --max-turns 0   # all turns
    python benchmarks/regen_throughput.py --runs old@2,old@1,new:64:256@1   # @THREADS: torch threads of one run

Honest by construction:

* the **old** path is the ``data_prep/regen.py`` of git revision ``--old-rev`` (the last commit before the fast path),
  loaded from git into a throw-away module and run as its CLI ran it (HF ``generate`` in batches of 8);
* every run reads the same input file: the first ``--n`` ShareGPT conversations, cut after ``--max-turns`` assistant
  turns *before* any run sees them (the old code has no ``--max-turns``), with the same ``--max-new-tokens`` and
  ``--max-prompt-tokens`` (the old ``Regenerator`` accepted the latter);
* new tokens are counted with one rule for both (ids up to and including the first stop token, else all
  ``max-new-tokens``): the old path's ``model.generate`` is wrapped to count them; the new path counts them itself;
* wall time is the whole ``regenerate_file`` call (rendering, tokenisation, generation, writing), one model load
  shared by all runs, after a warm-up forward;
* ``same text`` is the share of regenerated replies identical to the old path's (greedy fp32: padding and batch
  composition may flip a near-tie argmax now and then).

Runs (``--runs``): ``old`` and ``new:BATCH:POOL`` (POOL = conversations scheduled together; POOL = BATCH means no
bucketing beyond one batch), each optionally ``@THREADS`` (torch intra-op threads; default ``--threads`` = 1, the
new CLI's default on CPU; the old CLI ran with torch's default, all cores). Target: ``--target``, else the full tiny target
(``$VAT_HOME/tiny-target``) if built, else the quick one; the one used is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_REV = "b31f377"  # last commit with the HF-generate regen path


def load_old_module(rev: str) -> types.ModuleType:
    """``data_prep/regen.py`` at git revision ``rev``, as a module (its imports resolve against the installed vat)."""
    source = subprocess.run(
        ["git", "-C", REPO, "show", f"{rev}:data_prep/regen.py"], check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType("vat_regen_old")
    module.__file__ = f"{rev}:data_prep/regen.py"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def default_target() -> tuple[str, str]:
    from vat.paths import tiny_target_dir

    for size, name in (("full", "tiny (full)"), ("quick", "tiny-quick")):
        path = tiny_target_dir(size)
        if os.path.exists(os.path.join(path, "model.safetensors")):
            return path, name
    raise SystemExit("no tiny target built: run `vat prep tiny-target` (or --quick), or pass --target")


def write_input(path: str, n: int, max_turns: int) -> None:
    """The first ``n`` usable ShareGPT conversations, cut after ``max_turns`` assistant turns (0 = all)."""
    from vat.data_prep.chat import normalize_record
    from vat.data_prep.readers import iter_records
    from vat.paths import sharegpt_path

    written = 0
    with open(path, "w") as f:
        for record in iter_records(sharegpt_path()):
            messages, reason, _ = normalize_record(record)
            if reason:
                continue
            if max_turns:
                seen = 0
                for j, m in enumerate(messages):
                    seen += m["role"] == "assistant"
                    if seen == max_turns:
                        messages = messages[: j + 1]
                        break
            f.write(json.dumps({"id": str(record.get("id", written)), "messages": messages}) + "\n")
            written += 1
            if written >= n:
                break


def count_new_tokens(model, stop_ids: list[int], counter: dict) -> None:
    """Wrap ``model.generate`` (old path) to count new tokens with the new path's rule."""
    original = model.generate
    stop = set(stop_ids)

    def generate(*args, **kwargs):
        out = original(*args, **kwargs)
        for row in out[:, kwargs["input_ids"].shape[1] :].tolist():
            end = next((i for i, t in enumerate(row) if t in stop), None)
            counter["new_tokens"] += len(row) if end is None else end + 1
        return out

    model.generate = generate


def replies(path: str) -> dict[str, list[str]]:
    out = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            out[row["id"]] = [t["value"] for t in row["conversations"] if t["from"] == "gpt"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="target directory (default: the tiny target, full if built)")
    parser.add_argument("--n", type=int, default=128, help="conversations")
    parser.add_argument("--max-turns", type=int, default=2, help="assistant turns per conversation (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-tokens", type=int, default=408, help="tiny-regen's cap: 512 - 96 - 8")
    parser.add_argument(
        "--runs", default="old,new:8:8,new:64:256", help="comma list: old | new:BATCH:POOL, each optionally @THREADS"
    )
    parser.add_argument("--old-rev", default=OLD_REV, help="git revision of the old data_prep/regen.py")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of runs without @THREADS")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    from vat.data_prep import regen as new_regen

    if args.threads:
        torch.set_num_threads(args.threads)
    default_threads = torch.get_num_threads()
    target, target_name = (args.target, args.target) if args.target else default_target()
    model, tokenizer = new_regen.load_generator_model(target)
    old = load_old_module(args.old_rev)
    with torch.inference_mode():  # warm-up: first-call allocations and lazy init out of the timed runs
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"target {target_name}: {target} ({n_params / 1e6:.1f} M parameters, experts "
        f"{getattr(model.config, '_experts_implementation', '?')}, attention {model.config._attn_implementation})\n"
        f"{args.n} conversations, max turns {args.max_turns or 'all'}, max new tokens {args.max_new_tokens}, "
        f"max prompt tokens {args.max_prompt_tokens}; {default_threads} thread(s) unless @T, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; old path = {args.old_rev}:data_prep/regen.py"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="vat-regen-bench-") as tmp:
        src = os.path.join(tmp, "input.jsonl")
        write_input(src, args.n, args.max_turns)
        for spec in args.runs.split(","):
            run, _, threads = spec.partition("@")
            kind, *rest = run.split(":")
            out = os.path.join(tmp, f"{spec.replace(':', '_').replace('@', '_t')}.jsonl")
            torch.set_num_threads(int(threads) if threads else default_threads)
            torch.manual_seed(0)
            t0 = time.perf_counter()
            if kind == "old":
                counter = {"new_tokens": 0}
                regen = old.Regenerator(
                    model, tokenizer, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens
                )
                count_new_tokens(model, regen.stop_ids, counter)
                try:
                    stats = old.regenerate_file(src, out, regen, batch_size=8, progress=False)
                finally:
                    del model.generate  # the instance wrapper: back to the class method
                label, new_tokens = "old (HF generate, batch 8)", counter["new_tokens"]
                stats["new_tokens"] = new_tokens
                turns = regen.counts["turns_generated"]
            elif kind == "new":
                batch, pool = (int(x) for x in rest)
                regen = new_regen.Regenerator(
                    model,
                    tokenizer,
                    max_new_tokens=args.max_new_tokens,
                    max_prompt_tokens=args.max_prompt_tokens,
                    batch_size=batch,
                )
                stats = new_regen.regenerate_file(src, out, regen, pool_size=pool, progress=False)
                label, new_tokens = f"new (batch {batch}, pool {pool})", stats["new_tokens"]
                turns = regen.counts["turns_generated"]
            else:
                raise SystemExit(f"unknown run {spec!r}")
            seconds = time.perf_counter() - t0
            label += f", {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}"
            results.append(
                {
                    "run": spec,
                    "label": label,
                    "written": stats["written"],
                    "turns": turns,
                    "new_tokens": new_tokens,
                    "seconds": seconds,
                    "replies": replies(out),
                }
            )
            print(f"  {label}: {new_tokens} new tokens in {seconds:.1f} s", flush=True)
    base = results[0]
    print("\n| run | conversations | turns | new tokens | seconds | new tokens/s | conv/s | speed-up | same text |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        pairs = [(a, b) for k, v in r["replies"].items() for a, b in zip(v, base["replies"].get(k, []))]
        same = sum(a == b for a, b in pairs) / max(1, len(pairs))
        r["tokens_per_second"] = r["new_tokens"] / r["seconds"]
        r["same_text"] = same
        print(
            f"| {r['label']} | {r['written']} | {r['turns']} | {r['new_tokens']} | {r['seconds']:.1f} | "
            f"{r['tokens_per_second']:.0f} | {r['written'] / r['seconds']:.2f} | "
            f"{r['tokens_per_second'] / base['tokens_per_second']:.2f}x | {same:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "replies"} for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
