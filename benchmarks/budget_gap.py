"""The training-time vs eval-time acceptance gap under an expert budget, for one trained draft (docs/vat_losses.md).

    python benchmarks/budget_gap.py RUN [--budget B] [--eval EVAL_JSON] [--batches 4] [--output gap.json]

RUN is a `vat bench` cell (``cells/<method>/seed<N>``, with ``train/`` and ``eval/``) or a training output directory
(``config.yaml`` + ``final/``; pass ``--eval``). The draft is loaded from ``final/`` into the run's own trainer
(same target, data, drafter and loss switches) and scored on held-out batches: the batches of epoch 0 after the
ones the run trained on. For each batch it computes the per-anchor simulated acceptance length
``τ = 1 + Σ_k v_k`` (what the trainer logs as ``tau_sim``) of the anchors whose verification block starts in the
response, under:

- ``natural``: no budget;
- ``response``: the budget with ``budget.align: response`` windows (the trainer's default: restart at each response
  segment, a random phase per row);
- ``offset``: the budget with ``budget.align: offset`` windows (the earlier tiling: one absolute offset per step);
- ``per_anchor``: W forwards under the budget, one per phase φ; each anchor takes its τ from the forward in which its
  block ``[root, root + W)`` is one whole window (φ = (root − segment start) mod W): one forward per anchor, what no
  single forward can give;

and prints them beside the run's last logged ``tau_sim`` and eval's measured τ (pooled over benchmarks) with the
budgeted output's agreement, under the same B. ``--draws`` repeats the random layouts with other seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from dataclasses import replace

import torch

LAYOUTS = ("natural", "response", "offset", "per_anchor")


def _paths(run: str, eval_json: str | None) -> tuple[str, str | None]:
    """(train dir, eval.json or None) of a bench cell or a training output directory."""
    train = os.path.join(run, "train") if os.path.isdir(os.path.join(run, "train")) else run
    if not os.path.isfile(os.path.join(train, "config.yaml")) or not os.path.isdir(os.path.join(train, "final")):
        raise SystemExit(f"{run}: no config.yaml and final/ (a bench cell or a training output directory)")
    if eval_json is None:
        candidate = os.path.join(run, "eval", "eval.json")
        eval_json = candidate if os.path.isfile(candidate) else None
    return train, eval_json


def build_trainer(train_dir: str, budget: int | None, workdir: str):
    """The run's own trainer with its final draft loaded (``train.init_from``) and the budget ``B`` set."""
    from vat.config import load_config
    from vat.train.trainer import Trainer

    overrides = [f"train.init_from={os.path.join(train_dir, 'final')}", f"output_dir={workdir}", "resume=null",
                 "logging.progress=false", "train.lora=null"]
    if budget is not None:
        overrides.append(f"budget.B={budget}")
    cfg = load_config(os.path.join(train_dir, "config.yaml"), overrides)
    trainer = Trainer(cfg)
    trainer.setup()
    trainer.drafter.eval()
    return trainer


def _roots(trainer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, A) root position of each anchor's verification block (EAGLE-3: t + 1; DFlash: the anchor; -1 = none)."""
    B, T = batch["input_ids"].shape
    if trainer.cfg.drafter.kind == "dflash":
        from vat.drafters.dflash import sample_block_anchors

        gen = torch.Generator().manual_seed(  # the trainer's own seeding (Trainer._draft_slots)
            trainer.cfg.seed * 1_000_003 + 7919 * trainer.position.epoch + trainer.position.batch_index
            + 104_729 * trainer.accelerator.process_index)
        return sample_block_anchors(batch["loss_mask"], batch["attention_mask"], trainer.draft_config.block_size,
                                    trainer.cfg.drafter.num_anchors, gen)
    return torch.arange(1, T + 1).expand(B, T).clone()


def segment_starts(budgeted: torch.Tensor) -> torch.Tensor:
    """(B, T) column of the first position of the run of budgeted positions containing each position (-1 outside)."""
    B, T = budgeted.shape
    col = torch.arange(T).expand(B, T)
    before = torch.cat([torch.zeros_like(budgeted[:, :1]), budgeted[:, :-1]], dim=1)
    first = torch.where(budgeted & ~before, col, torch.full_like(col, -1)).cummax(dim=1).values
    return torch.where(budgeted, first, torch.full_like(first, -1))


@torch.no_grad()
def anchor_tau(trainer, batch: dict[str, torch.Tensor], budget) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor simulated acceptance length under ``budget`` (None = natural): ``(tau (B, A), valid (B, A))``."""
    from vat.verify import simulate_verification, target_dist

    tout = trainer._target_forward(batch, budget)
    dist = target_dist(tout.logits, trainer.draft_to_target)
    slots = trainer._draft_slots(batch, tout, dist)
    ver = simulate_verification(slots.logits, slots.target, slots.valid, acceptance=trainer.switches.acceptance,
                                censored=slots.censored)
    return (1.0 + ver.survival.sum(-1)).float().cpu(), ver.anchor_valid.cpu()


def batch_taus(trainer, batch: dict[str, torch.Tensor], draws: int) -> dict[str, tuple[float, float]]:
    """``{layout: (Σ τ, anchors)}`` over the anchors of one batch whose root is a response (budgeted) position."""
    budget, W = trainer.budget, trainer.budget_window
    budgeted = (batch["attention_mask"].bool() & batch["loss_mask"].bool()).cpu()  # (B, T)
    starts = segment_starts(budgeted)
    roots = _roots(trainer, batch)  # (B, A)
    B, T = budgeted.shape
    inside = (roots >= 0) & (roots < T)
    rooted = inside & budgeted.gather(1, roots.clamp(0, T - 1))  # (B, A) root in the response
    phase_of = (roots - starts.gather(1, roots.clamp(0, T - 1))) % W  # (B, A) the phase that makes the block whole
    out: dict[str, tuple[float, float]] = {}

    def add(name: str, tau: torch.Tensor, valid: torch.Tensor) -> None:
        keep = valid & rooted
        s, n = out.get(name, (0.0, 0.0))
        out[name] = (s + float(tau[keep].sum()), n + float(keep.sum()))

    add("natural", *anchor_tau(trainer, batch, None))
    for draw in range(draws):
        step = trainer.step
        trainer.step = step + 1_000 * draw  # another seeded phase / offset per draw
        for align in ("response", "offset"):
            trainer.cfg.budget.align = align
            tau, valid = anchor_tau(trainer, batch, trainer._budget_for_step(trainer.step) or budget)
            add(align, tau, valid)
        trainer.cfg.budget.align = "response"
        trainer.step = step
    exact = torch.zeros(roots.shape)
    exact_valid = torch.zeros(roots.shape, dtype=torch.bool)
    for phase in range(W):
        tau, valid = anchor_tau(trainer, batch, replace(budget, phase=(phase,) * B))
        mine = phase_of == phase
        exact = torch.where(mine, tau, exact)
        exact_valid = torch.where(mine, valid, exact_valid)
    add("per_anchor", exact, exact_valid)
    return out


def held_out_batches(trainer, n: int, start: int | None = None) -> tuple[list[list[int]], bool]:
    """The first ``n`` batches of epoch 0 after the ones the run trained on (``start``: after that many, e.g. when
    the run continued a draft trained on more of the same order); (batches, overlaps_training)."""
    epoch = trainer.batches.epoch(0)
    used = int(trainer.cfg.train.max_steps or 0) * int(trainer.cfg.train.grad_accum) if start is None else start
    if used + n <= len(epoch):
        return epoch[used:used + n], False
    return epoch[-n:], True


def eval_figures(eval_json: str | None, budget: int | None, final: str | None = None) -> dict[str, dict]:
    """``{draft: {"tau", "tau_natural", "agreement"}}`` pooled over benchmarks from eval.json (None where absent);
    only the draft evaluated from ``final`` when the eval.json names it (else every draft)."""
    if eval_json is None:
        return {}
    with open(eval_json) as f:
        data = json.load(f)
    label = "none" if budget is None else str(budget)
    paths = {d: os.path.realpath(e.get("path") or "") for d, e in data.get("drafts", {}).items()}
    mine = [d for d, path in paths.items() if final is not None and path == os.path.realpath(final)]
    out = {}
    for draft, by_budget in data.get("pooled", {}).items():
        if draft == "none" or (mine and draft not in mine):
            continue
        entry, natural = by_budget.get(label), by_budget.get("none")
        out[draft] = {
            "tau": entry.get("tau") if entry else None,
            "tau_natural": natural.get("tau") if natural else None,
            "agreement": ((entry or {}).get("quality") or {}).get("agreement"),
        }
    return out


def last_logged_tau(train_dir: str) -> float | None:
    path = os.path.join(train_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    last = None
    with open(path) as f:
        for line in f:
            if line.strip():
                last = json.loads(line).get("tau_sim", last)
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a bench cell (cells/<method>/seed<N>) or a training output directory")
    parser.add_argument("--budget", type=int, default=None, help="B (default: the run's budget.B)")
    parser.add_argument("--eval", dest="eval_json", default=None, help="eval.json (default: RUN/eval/eval.json)")
    parser.add_argument("--batches", type=int, default=4, help="held-out batches")
    parser.add_argument("--held-out-from", type=int, default=None,
                        help="first held-out batch of epoch 0 (default: the run's max_steps x grad_accum)")
    parser.add_argument("--draws", type=int, default=2, help="seeded phase / offset draws of the one-forward layouts")
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()

    train_dir, eval_json = _paths(args.run, args.eval_json)
    from vat.config import load_config

    budget = args.budget if args.budget is not None else load_config(os.path.join(train_dir, "config.yaml")).budget.B
    if budget is None:
        raise SystemExit("the run trained without a budget: pass --budget B")
    with tempfile.TemporaryDirectory(prefix="vat-gap-") as workdir:
        trainer = build_trainer(train_dir, int(budget), workdir)
        try:
            from vat.train.data import collate

            batches, overlap = held_out_batches(trainer, args.batches, args.held_out_from)
            sums: dict[str, tuple[float, float]] = {}
            for i, indices in enumerate(batches):
                trainer.position.batch_index = 10_000 + i  # seeds the layouts (and DFlash anchors) per batch
                batch = {k: v.to(trainer.device) for k, v in
                         collate([trainer.dataset[j] for j in indices], trainer.pad_id).items()}
                for name, (s, n) in batch_taus(trainer, batch, args.draws).items():
                    a, b = sums.get(name, (0.0, 0.0))
                    sums[name] = (a + s, b + n)
        finally:
            trainer.close()
    taus = {name: (s / n if n else math.nan) for name, (s, n) in sums.items()}
    anchors = int(sums["natural"][1])
    figures = eval_figures(eval_json, int(budget), os.path.join(train_dir, "final"))
    logged = last_logged_tau(train_dir)
    report = {"run": args.run, "budget": int(budget), "window": None, "held_out_batches": len(batches),
              "overlaps_training": overlap, "anchors": anchors, "tau_sim": taus, "logged_tau_sim": logged,
              "eval": figures, "eval_json": eval_json}
    print(f"budget gap: {args.run}  B={budget}  {len(batches)} held-out batches"
          f"{' (overlapping the training batches)' if overlap else ''}, {anchors} anchors rooted in the response")
    print(f"  {'layout':<12} τ_sim (simulated, held-out)")
    for name in LAYOUTS:
        print(f"  {name:<12} {taus.get(name, math.nan):.3f}")
    if logged is not None:
        print(f"  last logged tau_sim (training batches, the run's own windows): {logged:.3f}")
    for draft, f in figures.items():
        tau = "n/a (not evaluated at this B)" if f["tau"] is None else f"{f['tau']:.3f}"
        agree = "" if f["agreement"] is None else f", agreement {100 * f['agreement']:.1f} %"
        natural = "" if f["tau_natural"] is None else f"; natural routing τ {f['tau_natural']:.3f}"
        print(f"  eval ({draft}): τ under B={budget} {tau}{agree}{natural}")
        if f["tau"] is not None:
            gaps = ", ".join(f"{name} {taus[name] - f['tau']:+.3f}" for name in LAYOUTS if name in taus)
            print(f"  gap τ_sim − eval τ: {gaps}")
    if not figures:
        print("  eval: no eval.json (pass --eval)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
