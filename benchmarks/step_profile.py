"""Memory and time of one training step at the shipped real-target recipes' shapes, and the peak per GPU they predict.

    python benchmarks/step_profile.py                                        # every real-target draft recipe
    python benchmarks/step_profile.py --recipes recipes/olmoe_1b_7b/eagle3.yaml --tokens 64,128,256
    python benchmarks/step_profile.py --baseline-rev HEAD~5                  # the same cells with another vat, side by side
    python benchmarks/step_profile.py --force                                # measure again what the JSON already holds
    python benchmarks/step_profile.py --max-rss-gb 8                         # kill a cell whose RSS passes 8 GB

Every recipe of ``recipes/{qwen3_30b_a3b,mixtral_8x7b,olmoe_1b_7b}`` with ``kind: draft`` names a hub target that is
never downloaded here. Each target gets a **stand-in**: the real hidden size, vocabulary, attention heads / KV heads /
head_dim, MoE shape (experts, top-k, expert width), router convention (``norm_topk_prob``) and dense width, but **2
decoder layers** and random weights, built with transformers' own classes (``Qwen3MoeForCausalLM``,
``MixtralForCausalLM``, ``OlmoeForCausalLM``), stored in bfloat16 once under ``$VAT_HOME/step_profile/`` and reused
(:data:`REAL_SHAPES` holds the public shapes, with the full layer counts the memory model uses).

Aux layers: with 2 layers vat's own defaults stay valid, so nothing is overridden. ``default_aux_layer_ids`` clamps
EAGLE-3's ``[1, L//2 - 1, L - 4]`` into range (``[1, 0, 0]``) and DFlash's ``default_target_layer_ids`` gives
``[1, 0, 0, 0, 0]`` for 5 draft layers; the draft's ``fc`` keeps its real width (3 H or 5 H). The real target captures 3
(5) distinct layers: the missing ones are one of the layer-scaled terms below.

One cell = one (recipe, token count) in a **fresh subprocess** (peaks never mix): vat's own trainer
(:class:`vat.train.trainer.Trainer`, ``vat.config.load_config(recipe, overrides)``) runs ``train.max_steps=2`` with the
recipe's config and these overrides: the stand-in as ``target.path``; a synthetic prepared dataset (``datasets``,
columns ``input_ids``, ``loss_mask``, ``length``, ``id``; the first quarter of each row is prompt, the rest loss-masked)
whose every batch is ``rows x length = tokens`` exactly (``rows`` = the recipe's ``data.max_batch_size`` unless the
smallest token count would make rows shorter than two verification blocks); a draft vocabulary of the recipe's
``drafter.draft_vocab_size`` in ``vat prep vocab``'s format (EAGLE-3; DFlash predicts over the full vocabulary);
``data.tokens_per_batch`` = the token count; ``train.grad_accum=1`` (one micro-batch per step: the peak of a
micro-batch is the step's; the recipe's value is recorded); no checkpoints, no final write, no wandb;
``target.experts_impl=grouped_mm`` (the recipes' ``triton`` needs a GPU); ``budget.train_mix=0`` when the recipe has a
budget (both steps budgeted); DFlash: ``drafter.mask_token_id`` from the table (the stand-in has no tokenizer) and
``drafter.num_anchors`` scaled with the row length so blocks per token match the real rows (512 per 3072-token row).
The target stays in the recipe's dtype (bfloat16) and the draft trains under the recipe's ``train.mixed_precision``
(bf16 autocast, fp32 master weights; ``--mixed-precision no`` for fp32) on CPU as on GPU.

Measured per cell: peak memory (GPU: ``torch.cuda.max_memory_allocated``; CPU: the process's peak RSS, ``VmHWM``
after resetting it through ``/proc/self/clear_refs`` right before the first step, else ``ru_maxrss``) minus the
memory right before the first step (target, draft weights, data and the affinity table are loaded by then: the
**step memory** is what the steps add: activations, gradients, AdamW states, per-step tables), the absolute figures,
the seconds of the second step, and the cheap breakdown (target weight bytes, draft parameters, optimizer-state bytes,
affinity-table bytes). CPU caveats: RSS counts pages, not tensors (the allocator keeps freed memory, so it errs high),
glibc's heap is trimmed before the baseline reading; the stand-in's weights are copied out of the checkpoint's file
mapping as they load (:func:`in_anonymous_memory`: RSS would otherwise count converted weights twice); the step is one
thread; times are CPU times, not GPU times. What a CPU cell needs: the stand-in in bf16 plus the real-size draft with
its gradients, AdamW moments and AdamW's foreach temporary (about 20 B per draft parameter): OLMoE's EAGLE-3 cell
passes 6 GB of RSS at 64 tokens (2.0 GB stand-in, 158 M draft parameters); Qwen3's stand-in is 3.7 GB, Mixtral's 6.3 GB
beside a 425 M-parameter draft. ``--max-rss-gb`` kills a cell that passes a limit (recorded under ``failed``).

Memory model per recipe: step memory = a + b * tokens (least squares over the cells), then the predicted peak per GPU
(GB = 1e9 bytes) at the recipe's ``data.tokens_per_batch`` (tokens of one micro-batch on one rank: every rank runs its
own batch):

* the real target's weights at the recipe's dtype (:func:`param_count`: embeddings, attention, q/k norms, routers,
  experts, norms, LM head, all layers) and the draft's fp32 weights (4 B per parameter); its fp32 gradients (4 B) and
  AdamW's two fp32 moments (8 B) are inside the measured ``a`` (bf16 mixed precision keeps fp32 masters: 16 B per
  trained parameter in all, listed beside ``a``);
* the online affinity table at the real number of tracked MoE layers (measured bytes per layer x layers);
* ``a + b * tokens_per_batch``;
* what grows with the real layer count and the 2-layer stand-in cannot show (:func:`layer_terms`, from the shapes in
  ``vat.target.routing``, ``vat.losses``, ``vat.slots``, ``vat.affinity``): the captured top-k ids of every MoE layer
  per token (int64; twice under a budget), their fp32 one-hot (E + 1 wide) and EAGLE-3's per-position anchor routing
  (E wide), the affinity rows selected per token, DFlash's anchor routing per anchor, the union term's
  ``(M, K, L'', E)`` fp32 tensors (M = ``loss.union_max_anchors``; 4 copies when the union is trained, 2 when only
  logged), the per-step affinity table, and the aux layers the stand-in captures fewer of; the fit's own 2-layer union
  is taken back above the anchor cap;
* the attention masks at the real row shape (``rows x max_length``), which grow with the row length squared and are
  negligible in the short measured rows: EAGLE-3's TTT masks ``(B, T, (k+1) T)`` for k < K and DFlash's block mask
  ``(B, Q, T + Q)``, each kept for backward as SDPA's additive bias in the compute dtype (plus the live bool mask).

Then headroom against 80 GB and 141 GB, and whether the recipe fits the GPUs its header comment names with >= 10 %
headroom (a header that names no GPU memory is judged against 80 GB, and says so). Not modelled: the CUDA context,
NCCL buffers, DDP's gradient buckets (about the draft's gradient bytes once more), allocator fragmentation: the 10 %
headroom is for them.

``--baseline-rev REV`` measures the same cells with the ``vat`` package of git revision ``REV`` (``git archive`` into a
temporary directory, first on the subprocess's ``PYTHONPATH``; the subprocess checks ``vat.__file__``), with this
tree's recipes, stand-ins and data; the tables show both and the ratios (this tree / baseline).

Outputs: progress lines on stdout, ``OUT/step_profile.json`` (every cell, the fits, the predictions) and
``OUT/step_profile.md``; ``OUT`` defaults to ``runs/step_profile``. Resumable: a cell already in the JSON is skipped
unless ``--force``. Each cell's log is ``OUT/logs/<cell>.log``.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RECIPE_DIRS = ("qwen3_30b_a3b", "mixtral_8x7b", "olmoe_1b_7b")
STANDIN_LAYERS = 2
GB = 1e9
MB = 1e6
CAPACITIES_GB = (80.0, 141.0)
MIN_HEADROOM = 0.10
GPU_MEMORY_GB = {"H100": 80.0, "A100": 80.0, "H800": 80.0, "H200": 141.0, "B200": 192.0, "L40S": 48.0}
PROMPT_FRACTION = 0.25  # synthetic rows: the first quarter is prompt (loss mask 0), the rest is the answer
UNION_COPIES_TRAINED, UNION_COPIES_LOGGED = 4, 2  # live fp32 (M, K, L'', E) tensors of the union term

# the public shapes of the real targets (their config.json); `layers` is the full depth the memory model uses,
# `intermediate` the dense width the draft's MLP is sized from (vat.drafters.common.draft_dims_for_target)
REAL_SHAPES: dict[str, dict] = {
    "Qwen/Qwen3-30B-A3B": dict(
        family="qwen3_moe", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
        expert_intermediate=768, intermediate=6144, vocab=151936, norm_topk_prob=True, rope_theta=1e6,
        max_positions=40960, rms_norm_eps=1e-6, mask_token_id=151669,
    ),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": dict(
        family="mixtral", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, experts=8, top_k=2,
        expert_intermediate=14336, intermediate=14336, vocab=32000, rope_theta=1e6, max_positions=32768,
        rms_norm_eps=1e-5,
    ),
    "allenai/OLMoE-1B-7B-0125-Instruct": dict(
        family="olmoe", hidden=2048, layers=16, heads=16, kv_heads=16, head_dim=128, experts=64, top_k=8,
        expert_intermediate=1024, intermediate=1024, vocab=50304, norm_topk_prob=False, rope_theta=1e4,
        max_positions=4096, rms_norm_eps=1e-5,
    ),
}


# ---- shapes: analytic parameter counts and the stand-in ----------------------------------------------------------

def param_count(shape: dict, layers: int | None = None) -> dict[str, int]:
    """Parameters of a target of ``shape`` with ``layers`` decoder layers (default: its full depth), by part, as
    transformers builds the family (untied embeddings; no attention bias; every layer MoE).

    Per layer: q/k/v/o projections; q/k norms (Qwen3-MoE: one head_dim vector each; OLMoE: q over H, k over
    H / heads * kv_heads; Mixtral: none); the router (E x H); the experts (E x 3 x H x I: fused gate/up and down);
    two RMSNorms. Once: embeddings, final norm, LM head.
    """
    L = shape["layers"] if layers is None else layers
    H, V, E, width = shape["hidden"], shape["vocab"], shape["experts"], shape["expert_intermediate"]
    q_width, kv_width = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    qk_norm = {
        "qwen3_moe": 2 * shape["head_dim"],
        "olmoe": H + (H // shape["heads"]) * shape["kv_heads"],
        "mixtral": 0,
    }[shape["family"]]
    per_layer = {
        "attention": H * q_width + 2 * H * kv_width + q_width * H,
        "qk_norms": qk_norm,
        "router": E * H,
        "experts": 3 * E * H * width,
        "layer_norms": 2 * H,
    }
    counts = {name: L * n for name, n in per_layer.items()}
    counts.update(embeddings=V * H, final_norm=H, lm_head=V * H)
    counts["total"] = sum(counts.values())
    return counts


def standin_config(shape: dict, layers: int = STANDIN_LAYERS):
    """A transformers config of the real shape with ``layers`` decoder layers (random weights come from it)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=layers,
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["max_positions"], rms_norm_eps=shape["rms_norm_eps"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(shape["rope_theta"])},
    )
    family = shape["family"]
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, head_dim=shape["head_dim"], intermediate_size=shape["intermediate"],
            moe_intermediate_size=shape["expert_intermediate"], num_experts=shape["experts"],
            num_experts_per_tok=shape["top_k"], norm_topk_prob=shape["norm_topk_prob"], decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if family == "mixtral":
        return MixtralConfig(
            **common, head_dim=shape["head_dim"], intermediate_size=shape["expert_intermediate"],
            num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
        )
    if family == "olmoe":
        return OlmoeConfig(
            **common, intermediate_size=shape["expert_intermediate"], num_experts=shape["experts"],
            num_experts_per_tok=shape["top_k"], norm_topk_prob=shape["norm_topk_prob"],
        )
    raise ValueError(f"no stand-in for family {family}")


def build_standin(shape: dict, path: str, layers: int = STANDIN_LAYERS, dtype: str = "bfloat16", seed: int = 0) -> dict:
    """Save a random model of ``shape`` with ``layers`` layers to ``path`` (``from_pretrained`` layout) plus
    ``standin.json``; written beside ``path`` first, so a killed build leaves nothing that looks finished."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(standin_config(shape, layers), dtype=getattr(torch, dtype))
    params = sum(p.numel() for p in model.parameters())
    info = {"shape": shape, "layers": layers, "dtype": dtype, "params": params,
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "analytic_params": param_count(shape, layers)["total"]}
    staging = path + ".building"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    with open(os.path.join(staging, "standin.json"), "w") as f:
        json.dump(info, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(staging, path)
    return info


def standin_dir(model_id: str) -> str:
    from vat.paths import vat_home

    return os.path.join(vat_home(), "step_profile", f"{model_id.replace('/', '--')}-{STANDIN_LAYERS}layers")


# ---- the memory model ------------------------------------------------------------------------------------------

def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b)``."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct x")
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def attention_mask_bytes(facts: dict) -> float:
    """The attention masks of one micro-batch at the real row shape (``rows x length``), kept for backward.

    EAGLE-3: step k of the TTT unroll attends over a ``(B, T, (k+1) T)`` mask; DFlash: ``(B, Q, T + Q)`` with
    ``Q = anchors x block`` per row, one SDPA call per draft layer. Each call keeps SDPA's additive bias in the compute
    dtype; the bool mask itself (1 B) is live once.
    """
    B, T, c = facts["rows_real"], facts["length_real"], facts["compute_bytes"]
    if facts["kind"] == "eagle3":
        per_step = [B * T * (k + 1) * T for k in range(facts["ttt_steps"])]
        return sum(per_step) * c + max(per_step)
    Q = facts["anchors_per_row_real"] * facts["block_size"]
    elements = B * Q * (T + Q)
    return elements * (c * facts["draft_layers"] + 1)


def layer_terms(facts: dict, standin: dict) -> dict[str, float]:
    """Bytes the real target's depth adds over the 2-layer stand-in's (see the module docstring), by term.

    ``facts``: the recipe at its real shape (:func:`recipe_facts`); ``standin``: the stand-in's measured facts (MoE
    and tracked layers, affinity bytes per tracked layer, distinct aux layers)."""
    T, k, E = facts["tokens_real"], facts["top_k"], facts["experts"]
    d_moe = facts["moe_layers_real"] - standin["moe_layers"]
    d_tracked = facts["tracked_layers_real"] - standin["tracked_layers"]
    per_token_layer = 8 * k * (2 if facts["budget"] else 1) + 4 * (E + 1) + (4 * E if facts["kind"] == "eagle3" else 0)
    terms = {
        "routing_ids_and_onehots": d_moe * T * per_token_layer + d_tracked * T * 8 * k,
        "anchor_routing_dflash": d_moe * facts["anchors_real"] * 4 * E if facts["kind"] == "dflash" else 0.0,
    }
    copies = UNION_COPIES_TRAINED if facts["union_trained"] else UNION_COPIES_LOGGED
    per_anchor_layer = copies * facts["slots"] * E * 4  # fp32 (M, K, L'', E)
    terms["union_term"] = d_tracked * facts["union_anchors_real"] * per_anchor_layer
    # the fit's slope carries the stand-in's own union at every anchor; above the anchor cap the real step has fewer
    extrapolated = facts["anchors_per_token"] * T
    terms["union_anchor_cap"] = -standin["tracked_layers"] * per_anchor_layer * max(
        0.0, extrapolated - facts["union_anchors_real"])
    terms["affinity_per_step_table"] = d_tracked * standin["affinity_step_bytes_per_layer"]
    terms["aux_capture"] = (facts["aux_distinct_real"] - standin["aux_distinct"]) * facts["hidden"] * T * facts[
        "target_bytes"]
    return terms


def predict_peak(facts: dict, standin: dict, a: float, b: float) -> dict:
    """The predicted peak per GPU of the recipe at its real shape: itemized bytes, the total, headroom per capacity."""
    items = {
        "target_weights": facts["target_params_real"] * facts["target_bytes"],
        "draft_weights_fp32": standin["draft_params"] * 4.0,
        "affinity_table": standin["affinity_bytes_per_layer"] * facts["tracked_layers_real"],
        "step_intercept_a": a,
        "step_per_token_b_x_tokens": b * facts["tokens_real"],
    }
    items.update(layer_terms(facts, standin))
    items["attention_masks_real_rows"] = attention_mask_bytes(facts)
    total = sum(items.values())
    out = {"items_bytes": items, "total_bytes": total,
           "draft_grads_and_adam_bytes_in_a": standin["trainable_params"] * 12.0}
    out["headroom"] = {f"{int(c)}GB": headroom(total, c * GB) for c in CAPACITIES_GB}
    return out


def headroom(total_bytes: float, capacity_bytes: float) -> float:
    """Free fraction of ``capacity_bytes`` left by ``total_bytes`` (negative = does not fit)."""
    return (capacity_bytes - total_bytes) / capacity_bytes


def stated_hardware(recipe_text: str) -> dict:
    """The GPUs a recipe's header comment names: count and memory per GPU (None when it names none). Memory is read
    only next to a GPU: ``80 GB GPUs``, ``H100 80GB``, or a known name alone (``H200``); other GB figures of a header
    (logits, tables) are not GPUs."""
    header = "\n".join(line for line in recipe_text.splitlines() if line.startswith("#"))
    count = re.search(r"\b(\d+)\s+(?:[A-Za-z0-9-]+\s+)?GPUs", header)  # "8 GPUs", "8 H200 GPUs"
    names = "|".join(GPU_MEMORY_GB)
    memory = None
    sized = re.search(rf"\b(\d+)\s*GB\s+GPUs?\b|\b(?:{names})[\s-]*(\d+)\s*GB\b", header)
    named = re.search(rf"\b({names})\b", header)
    if sized:
        memory = float(sized.group(1) or sized.group(2))
    elif named:
        memory = GPU_MEMORY_GB[named.group(1)]
    return {"gpus": int(count.group(1)) if count else None, "memory_gb": memory}


def verdict(total_bytes: float, hardware: dict) -> dict:
    """Whether ``total_bytes`` fits the stated GPU with at least :data:`MIN_HEADROOM` free (80 GB when unstated)."""
    memory = hardware["memory_gb"] or CAPACITIES_GB[0]
    room = headroom(total_bytes, memory * GB)
    return {"judged_against_gb": memory, "assumed": hardware["memory_gb"] is None, "headroom": room,
            "fits": room >= MIN_HEADROOM}


# ---- recipes ---------------------------------------------------------------------------------------------------

def recipe_facts(recipe: str) -> dict:
    """What the memory model needs from a recipe, at its real shape (the config as ``vat train`` would load it)."""
    from vat.config import load_config

    cfg = load_config(recipe)
    shape = REAL_SHAPES.get(cfg.target.path)
    if shape is None:
        raise SystemExit(f"{recipe}: no real shape for target {cfg.target.path}; add it to REAL_SHAPES")
    kind, tokens = cfg.drafter.kind, int(cfg.data.tokens_per_batch)
    rows = max(1, min(int(cfg.data.max_batch_size), tokens // int(cfg.data.max_length)))
    length = min(int(cfg.data.max_length), tokens // rows)
    anchors_per_row = min(int(cfg.drafter.num_anchors), length) if kind == "dflash" else length
    tracked = len(range(0, shape["layers"], int(cfg.loss.affinity_layer_stride)))
    union_cap = cfg.loss.union_max_anchors
    anchors = rows * anchors_per_row
    facts = dict(
        kind=kind, method=cfg.method, target=cfg.target.path, tokens_real=tokens, rows_real=rows, length_real=length,
        max_batch_size=int(cfg.data.max_batch_size), max_length=int(cfg.data.max_length),
        grad_accum=int(cfg.train.grad_accum), mixed_precision=cfg.train.mixed_precision,
        compute_bytes=4 if cfg.train.mixed_precision == "no" else 2,  # auto = bf16 on a GPU
        target_dtype=cfg.target.dtype, target_bytes=2 if cfg.target.dtype in ("bfloat16", "float16") else 4,
        target_params_real=param_count(shape)["total"], hidden=shape["hidden"], experts=shape["experts"],
        top_k=shape["top_k"], moe_layers_real=shape["layers"], tracked_layers_real=tracked,
        budget=cfg.budget.B is not None, union_trained=bool(cfg.loss.union_weight),
        slots=int(cfg.drafter.ttt_steps) if kind == "eagle3" else int(cfg.drafter.block_size) - 1,
        ttt_steps=int(cfg.drafter.ttt_steps), block_size=int(cfg.drafter.block_size),
        num_anchors=int(cfg.drafter.num_anchors), draft_layers=int(cfg.drafter.num_layers),
        anchors_per_row_real=anchors_per_row, anchors_real=anchors,
        anchors_per_token=(anchors / tokens) if kind == "dflash" else 1.0 - PROMPT_FRACTION,
        union_anchors_real=min(anchors, union_cap) if union_cap else anchors,
        aux_distinct_real=3 if kind == "eagle3" else int(cfg.drafter.num_layers),
        draft_vocab_size=int(cfg.drafter.draft_vocab_size),
    )
    with open(recipe) as f:
        facts["hardware"] = stated_hardware(f.read())
    return facts


def list_recipes(paths: list[str]) -> tuple[list[str], list[str]]:
    """(draft recipes to profile, skipped ``kind: window_pool`` recipes), as paths relative to the repository."""
    if not paths:
        paths = sorted(p for d in DEFAULT_RECIPE_DIRS for p in glob.glob(os.path.join(REPO, "recipes", d, "*.yaml")))
    keep, skipped = [], []
    for path in paths:
        path = os.path.relpath(os.path.abspath(path), REPO)
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        (skipped if re.search(r"^kind:\s*window_pool\b", text, re.M) else keep).append(path)
    return keep, skipped


def cell_rows(facts: dict, token_counts: list[int]) -> int:
    """Rows per batch for every cell of a recipe: the recipe's batch size, fewer when the smallest count would make
    rows shorter than two verification blocks (EAGLE-3: 2 (K + 1); DFlash: 2 blocks); every count must divide."""
    min_length = 2 * (facts["ttt_steps"] + 1) if facts["kind"] == "eagle3" else 2 * facts["block_size"]
    for rows in range(facts["max_batch_size"], 0, -1):
        if all(t % rows == 0 for t in token_counts) and min(token_counts) // rows >= min_length:
            return rows
    raise SystemExit(f"token counts {token_counts} give no row length >= {min_length}: use larger --tokens")


def cell_overrides(facts: dict, standin: str, data: dict, tokens: int, rows: int, args, workdir: str) -> list[str]:
    """The overrides that turn a recipe into one profiling cell (module docstring)."""
    length = tokens // rows
    out = [
        f"target.path={standin}", f"target.experts_impl={args.experts_impl}",
        f"target.dtype={args.target_dtype or facts['target_dtype']}", f"data.train={data['dir']}",
        f"data.tokens_per_batch={tokens}", f"data.max_batch_size={rows}",
        f"data.max_length={max(facts['max_length'], length)}", "data.shuffle=false", "train.max_steps=2",
        "train.grad_accum=1", "train.save_every=0", "logging.wandb.mode=disabled", "logging.progress=false",
        f"train.mixed_precision={args.mixed_precision or facts['mixed_precision']}", f"output_dir={workdir}",
    ]
    if facts["kind"] == "eagle3":
        out.append(f"data.vocab={data['vocab']}")
    else:
        mask = REAL_SHAPES[facts["target"]].get("mask_token_id", REAL_SHAPES[facts["target"]]["vocab"] - 1)
        anchors = max(1, round(facts["anchors_per_row_real"] * length / facts["length_real"]))
        out += [f"drafter.mask_token_id={mask}", f"drafter.num_anchors={anchors}"]
    if facts["budget"]:
        out.append("budget.train_mix=0.0")
    return out


# ---- synthetic data --------------------------------------------------------------------------------------------

def ensure_data(root: str, vocab_size: int, draft_vocab_size: int, tokens: int, rows: int) -> dict:
    """Two batches of ``rows`` rows of ``tokens // rows`` random ids (prepared-dataset layout) and a draft vocabulary
    counted from them, under ``root``; built once."""
    length = tokens // rows
    directory = os.path.join(root, f"V{vocab_size}_T{tokens}_r{rows}")
    vocab = os.path.join(directory, f"draft_vocab_{draft_vocab_size}.safetensors")
    if os.path.exists(os.path.join(directory, "dataset_info.json")) and os.path.exists(vocab):
        return {"dir": directory, "vocab": vocab, "length": length}
    import datasets
    import torch

    from vat.data_prep.vocab import build_draft_vocab, count_tokens, save_draft_vocab

    gen = torch.Generator().manual_seed(tokens * 7919 + rows)
    n = 2 * rows  # two steps, two distinct batches
    ids = torch.randint(0, vocab_size, (n, length), generator=gen)  # (n, length)
    prompt = int(length * PROMPT_FRACTION)
    mask = [[0] * prompt + [1] * (length - prompt)] * n
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": mask, "length": [length] * n,
                                     "id": [str(i) for i in range(n)]})
    ds.save_to_disk(directory)
    d2t, t2d = build_draft_vocab(count_tokens(ds, vocab_size), draft_vocab_size)
    save_draft_vocab(vocab, d2t, t2d, {"source_data": directory})
    return {"dir": directory, "vocab": vocab, "length": length}


# ---- one cell, in its own process ------------------------------------------------------------------------------

def memory_now(device) -> dict:
    """The process's memory now: RSS and peak RSS (bytes), and the CUDA allocator's figures on a GPU."""
    import resource

    import torch

    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024
    out = {"rss": status.get("VmRSS"), "hwm": status.get("VmHWM"),
           "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        out.update(cuda_allocated=torch.cuda.memory_allocated(device), cuda_peak=torch.cuda.max_memory_allocated(device))
    return out


def reset_peaks(device) -> bool:
    """Free what can be freed, then reset the peak counters; returns whether the RSS peak (VmHWM) was reset."""
    import ctypes

    import torch

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed heap: give it back before the baseline reading
    except OSError:
        pass
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (and ru_maxrss) to the current RSS
        return True
    except OSError:
        return False


def profiled_trainer(trainer_class):
    """``trainer_class`` with the loop's hooks wrapped: memory right before the first step, each step's start and
    end, the batch shapes; no final write."""

    class ProfiledTrainer(trainer_class):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.profile: dict = {"starts": [], "ends": [], "shapes": [], "budgeted": []}

        def _sync(self):
            import torch

            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def on_run_start(self):
            super().on_run_start()
            self.profile["hwm_reset"] = reset_peaks(self.device)
            self.profile["before"] = memory_now(self.device)

        def next_batch(self):
            indices, batch = super().next_batch()
            self.profile["shapes"].append(list(batch["input_ids"].shape))
            return indices, batch

        def step_context(self, step):
            self._sync()
            self.profile["starts"].append(time.perf_counter())
            context = super().step_context(step)
            self.profile["budgeted"].append(context is not None)
            return context

        def after_step(self):
            super().after_step()
            self._sync()
            self.profile["ends"].append(time.perf_counter())

        def save_final(self, last):
            self.profile["last_record"] = last

    return ProfiledTrainer


def trainer_facts(trainer) -> dict:
    """The cheap breakdown: target weight bytes, draft parameters, optimizer-state and affinity bytes, layers."""
    import torch

    target = trainer.target
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    drafter = trainer.accelerator.unwrap_model(trainer.drafter)
    affinity = trainer.affinity
    affinity_bytes = sum(t.numel() * t.element_size() for t in affinity.state_dict().values())
    tracked = len(affinity.layer_index)
    table = affinity.table()
    return {
        "target_weight_bytes": sum(p.numel() * p.element_size() for p in target.model.parameters()),
        "target_params": sum(p.numel() for p in target.model.parameters()),
        "draft_params": sum(p.numel() for p in drafter.parameters()),
        "trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "optimizer_state_bytes": state_bytes,
        "moe_layers": len(target.moe_layer_ids), "tracked_layers": tracked,
        "affinity_bytes_per_layer": affinity_bytes / max(tracked, 1),
        "affinity_step_bytes_per_layer": table.numel() * table.element_size() / max(tracked, 1),
        "aux_layer_ids": list(target.aux_layer_ids), "aux_distinct": len(set(target.aux_layer_ids)),
    }


def in_anonymous_memory(load):
    """``load_target`` whose CPU weights are copied out of the checkpoint's file mapping. ``from_pretrained`` keeps the
    safetensors file mapped for the tensors it did not convert, so RSS would count the converted ones (the fused
    experts) twice: copy and source pages (2 GB of OLMoE's stand-in counted 3.6 GB). On a GPU the weights are copied
    to the device anyway; this does the same on the CPU, before the draft shares the embedding."""
    import torch

    def load_copied(*args, **kwargs):
        target = load(*args, **kwargs)
        with torch.no_grad():
            for param in target.model.parameters():
                if param.device.type == "cpu":
                    param.data = param.data.clone()
        gc.collect()
        return target

    return load_copied


def target_loader_module():
    """The module whose ``load_target`` the trainer's setup calls: ``vat.train.setup``, or ``vat.train.trainer`` in a
    vat from before the setup had its own module (the script profiles any checkout, ``vat_root``); None if neither."""
    import importlib

    for name in ("vat.train.setup", "vat.train.trainer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "load_target"):
            return module
    return None


def run_cell(spec: dict) -> dict:
    """Worker: one cell (two training steps of the recipe on the stand-in); returns the measurements."""
    import torch

    torch.set_num_threads(spec["threads"])
    import vat
    import vat.train.trainer as trainer_module
    from vat.config import load_config

    expected = spec.get("vat_root")
    if expected and not os.path.abspath(vat.__file__).startswith(os.path.abspath(expected) + os.sep):
        raise SystemExit(f"imported vat from {vat.__file__}, expected under {expected}")
    loader = target_loader_module()
    original = getattr(loader, "load_target", None)
    if original is not None:  # the setup's own name for it: the setup then loads through the wrapper
        loader.load_target = in_anonymous_memory(original)
    trainer = profiled_trainer(trainer_module.Trainer)(load_config(spec["recipe"], spec["overrides"]))
    t0 = time.perf_counter()
    try:
        trainer.setup()
        setup_s = time.perf_counter() - t0
        trainer.run()
        after = memory_now(trainer.device)
        facts = trainer_facts(trainer)
    finally:
        if original is not None:
            loader.load_target = original
        if hasattr(trainer, "target"):
            trainer.close()
    profile = trainer.profile
    if "before" not in profile or len(profile["ends"]) < 2:
        raise SystemExit(f"the trainer of {vat.__file__} never called the loop hooks this script reads (on_run_start, "
                         "step_context, after_step): it cannot be profiled")
    before = profile["before"]
    peak_key = "cuda_peak" if trainer.device.type == "cuda" else ("hwm" if profile["hwm_reset"] else "ru_maxrss")
    base_key = "cuda_allocated" if trainer.device.type == "cuda" else "rss"
    steps = [e - s for s, e in zip(profile["starts"], profile["ends"])]
    return {
        "vat_file": vat.__file__, "device": str(trainer.device), "threads": torch.get_num_threads(),
        "weights_out_of_file_mapping": original is not None,
        "setup_s": setup_s, "step_s": steps, "step2_s": steps[1] if len(steps) > 1 else None,
        "batch_shapes": profile["shapes"], "budgeted_steps": profile["budgeted"],
        "peak_source": peak_key, "hwm_reset": profile["hwm_reset"], "before": before, "after": after,
        "peak_bytes": after[peak_key], "before_bytes": before[base_key],
        "step_bytes": after[peak_key] - before[base_key], "torch": torch.__version__, **facts,
    }


def worker_main(spec_path: str) -> int:
    """``--worker SPEC.json``: a build or a cell, its result written to ``spec["result"]``."""
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["job"] == "build":
        result = build_standin(spec["shape"], spec["path"])
    else:
        result = run_cell(spec)
    with open(spec["result"], "w") as f:
        json.dump(result, f, indent=2)
    return 0


# ---- the orchestrator ------------------------------------------------------------------------------------------

def run_worker(spec: dict, log_path: str, args, pythonpath: str | None) -> dict | None:
    """Run one worker subprocess (``args.cell_timeout`` seconds, ``args.max_rss_gb`` of RSS at most); its result, or
    None (the log's tail is printed)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OMP_WAIT_POLICY="PASSIVE",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        spec = dict(spec, result=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", spec_path], cwd=REPO,
                                    env=env, stdout=log, stderr=subprocess.STDOUT)
            code = watch(proc, args.cell_timeout, args.max_rss_gb)
            if not isinstance(code, int):
                log.write(f"\n[step_profile] killed: {code}\n")
        if code == 0 and os.path.exists(spec["result"]):
            with open(spec["result"]) as f:
                return json.load(f)
    with open(log_path) as f:
        tail = "\n".join(f.read().splitlines()[-6:])
    print(f"  failed ({code}); log {log_path} ends:\n{tail}", flush=True)
    return None


def watch(proc, timeout: float, max_rss_gb: float | None):
    """Wait for ``proc``; kill it past ``timeout`` seconds or ``max_rss_gb`` of RSS. Its exit code, or why it was
    killed."""
    start = time.monotonic()
    while proc.poll() is None:
        time.sleep(0.5)
        rss = process_rss(proc.pid)
        reason = None
        if time.monotonic() - start > timeout:
            reason = f"timeout after {timeout:.0f} s"
        elif max_rss_gb and rss is not None and rss > max_rss_gb * GB:
            reason = f"RSS {rss / GB:.2f} GB over --max-rss-gb {max_rss_gb}"
        if reason:
            proc.kill()
            proc.wait()
            return reason
    return proc.returncode


def process_rss(pid: int) -> int | None:
    """The resident set of process ``pid`` in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def ensure_standin(model_id: str, args) -> dict:
    """The stand-in of ``model_id`` (built in a subprocess the first time): its directory and ``standin.json``."""
    path = standin_dir(model_id)
    info_path = os.path.join(path, "standin.json")
    if not os.path.exists(info_path):
        print(f"[step_profile] building the {STANDIN_LAYERS}-layer stand-in of {model_id} -> {path}", flush=True)
        t0 = time.perf_counter()
        spec = {"job": "build", "shape": REAL_SHAPES[model_id], "path": path}
        log = os.path.join(args.out, "logs", f"build-{model_id.replace('/', '--')}.log")
        if run_worker(spec, log, args, REPO) is None:
            raise SystemExit(f"stand-in build failed for {model_id}")
        print(f"  built in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(info_path) as f:
        return {"dir": path, **json.load(f)}


def load_results(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
        results.setdefault("failed", {})
        return results
    return {"cells": {}, "failed": {}, "standins": {}, "recipes": {}, "skipped": [], "revisions": {}}


def save_results(results: dict, out: str) -> None:
    path = os.path.join(out, "step_profile.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=2)
    os.replace(path + ".tmp", path)


def cell_key(rev: str, recipe: str, tokens: int) -> str:
    return f"{rev}|{recipe}|{tokens}"


def measure_recipe(recipe: str, facts: dict, revisions: dict, results: dict, args) -> None:
    """Every (revision, token count) cell of one recipe not yet in ``results`` (or all with ``--force``)."""
    standin = ensure_standin(facts["target"], args)
    results["standins"][facts["target"]] = {k: v for k, v in standin.items() if k != "shape"}
    rows = cell_rows(facts, args.tokens)
    for tokens in args.tokens:
        data = ensure_data(os.path.join(args.out, "data"), REAL_SHAPES[facts["target"]]["vocab"],
                           facts["draft_vocab_size"], tokens, rows)
        for rev, root in revisions.items():
            key = cell_key(rev, recipe, tokens)
            if key in results["cells"] and not args.force:
                print(f"[step_profile] {key}: in the JSON, skipped (--force measures again)", flush=True)
                continue
            workdir = os.path.join(args.out, "work", key.replace("|", "__").replace("/", "_"))
            spec = {"job": "cell", "recipe": os.path.join(REPO, recipe), "threads": args.threads, "vat_root": root,
                    "overrides": cell_overrides(facts, standin["dir"], data, tokens, rows, args, workdir)}
            print(f"[step_profile] {key}: {rows} x {tokens // rows} tokens, vat from {root} ...", flush=True)
            t0 = time.perf_counter()
            log_path = os.path.join(args.out, "logs", os.path.basename(workdir) + ".log")
            cell = run_worker(spec, log_path, args, root)
            shutil.rmtree(workdir, ignore_errors=True)
            if cell is None:
                results["failed"][key] = f"see {os.path.relpath(log_path, args.out)}"
                save_results(results, args.out)
                continue
            results["failed"].pop(key, None)
            cell.update(tokens=tokens, rows=rows, length=tokens // rows, recipe=recipe, revision=rev,
                        overrides=spec["overrides"], wall_s=time.perf_counter() - t0)
            results["cells"][key] = cell
            save_results(results, args.out)
            step2 = f"{cell['step2_s']:.1f} s" if cell["step2_s"] is not None else "n/a"
            print(f"  peak step {cell['step_bytes'] / MB:.0f} MB (absolute {cell['peak_bytes'] / MB:.0f} MB, "
                  f"{cell['peak_source']}), step 2: {step2}, wall {cell['wall_s']:.0f} s", flush=True)


def model_for(recipe: str, rev: str, facts: dict, results: dict) -> dict | None:
    """The fit and prediction of one recipe at one revision, from its cells (None with fewer than 2 token counts)."""
    cells = sorted((c for c in results["cells"].values() if c["recipe"] == recipe and c["revision"] == rev),
                   key=lambda c: c["tokens"])
    if len({c["tokens"] for c in cells}) < 2:
        return None
    xs, ys = [c["tokens"] for c in cells], [c["step_bytes"] for c in cells]
    a, b = fit_line(xs, ys)
    standin = cells[-1]
    prediction = predict_peak(facts, standin, a, b)
    residual = max(abs(y - (a + b * x)) for x, y in zip(xs, ys))
    return {"a_bytes": a, "b_bytes_per_token": b, "points": list(zip(xs, ys)), "max_residual_bytes": residual,
            "prediction": prediction, "verdict": verdict(prediction["total_bytes"], facts["hardware"])}


# ---- the report ------------------------------------------------------------------------------------------------

def cell_table(recipe: str, revisions: list[str], results: dict) -> list[str]:
    """Markdown rows: tokens, rows x length, peak step MB and step-2 seconds (and the baseline's, with ratios)."""
    base = revisions[1] if len(revisions) > 1 else None
    head = "| tokens | rows x length | peak step MB | step 2 s |"
    rule = "|---|---|---|---|"
    if base:
        head += f" {base} peak MB | ratio | {base} s | ratio |"
        rule += "---|---|---|---|"
    lines = [head, rule]
    cells = {c["tokens"]: c for c in results["cells"].values() if c["recipe"] == recipe and c["revision"] == revisions[0]}
    for tokens in sorted(cells):
        c = cells[tokens]
        row = f"| {tokens} | {c['rows']} x {c['length']} | {c['step_bytes'] / MB:.0f} | {fmt(c['step2_s'], '.2f')} |"
        if base:
            o = results["cells"].get(cell_key(base, recipe, tokens))
            if o is None:
                row += " - | - | - | - |"
            else:
                row += (f" {o['step_bytes'] / MB:.0f} | {ratio(c['step_bytes'], o['step_bytes'])} | "
                        f"{fmt(o['step2_s'], '.2f')} | {ratio(c['step2_s'], o['step2_s'])} |")
        lines.append(row)
    return lines


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def ratio(new, old) -> str:
    return "n/a" if not new or not old else f"{new / old:.2f}"


def summary_rows(results: dict, rev: str) -> list[str]:
    """One markdown row per recipe: prediction, headroom at 80 / 141 GB, the stated hardware and the verdict."""
    lines = ["| recipe | a MB | b KB/token | tokens/rank | predicted peak/GPU GB | target weights GB | 80 GB headroom | "
             "141 GB headroom | stated hardware | fits (>= 10 % headroom) |", "|---" * 10 + "|"]
    for recipe, entry in sorted(results["recipes"].items()):
        model = entry["models"].get(rev)
        if model is None:
            continue
        p, v, hw = model["prediction"], model["verdict"], entry["facts"]["hardware"]
        stated = f"{hw['gpus'] or '?'} GPUs, {hw['memory_gb']:.0f} GB" if hw["memory_gb"] else (
            f"{hw['gpus'] or '?'} GPUs, memory unstated (judged at 80 GB)")
        lines.append(
            f"| {recipe} | {model['a_bytes'] / MB:.0f} | {model['b_bytes_per_token'] / 1e3:.1f} | "
            f"{entry['facts']['tokens_real']} | {p['total_bytes'] / GB:.1f} | "
            f"{p['items_bytes']['target_weights'] / GB:.1f} | {p['headroom']['80GB']:.0%} | {p['headroom']['141GB']:.0%} | "
            f"{stated} | {'yes' if v['fits'] else 'no'} ({v['headroom']:.0%}) |")
    return lines


def items_table(results: dict, rev: str) -> list[str]:
    """The prediction's terms per recipe (GB), one column per recipe."""
    recipes = [r for r, e in sorted(results["recipes"].items()) if rev in e["models"]]
    if not recipes:
        return []
    names = list(results["recipes"][recipes[0]]["models"][rev]["prediction"]["items_bytes"])
    lines = ["| term (GB) | " + " | ".join(recipes) + " |", "|---" * (len(recipes) + 1) + "|"]
    for name in names + ["total"]:
        values = []
        for r in recipes:
            p = results["recipes"][r]["models"][rev]["prediction"]
            values.append(p["total_bytes"] if name == "total" else p["items_bytes"][name])
        lines.append(f"| {name} | " + " | ".join(f"{v / GB:.2f}" for v in values) + " |")
    return lines


def write_markdown(results: dict, revisions: list[str], out: str) -> str:
    meta = results.get("meta", {})
    lines = ["# One training step at the real recipes' shapes (2-layer stand-in targets)", "",
             f"Device {meta.get('device') or '?'}, {meta.get('threads') or '?'} thread(s), torch {meta.get('torch') or '?'}. "
             "Peak step = peak memory minus the memory right before the first step (CPU: RSS); MB = 1e6 B, "
             "GB = 1e9 B. Method: benchmarks/step_profile.py's docstring.", ""]
    for recipe in sorted(results["recipes"]):
        lines += [f"## {recipe}", ""] + cell_table(recipe, revisions, results) + [""]
    for rev in revisions:
        lines += [f"## Predicted peak per GPU ({rev})", ""] + summary_rows(results, rev) + [""]
        lines += ["Terms of the prediction:", ""] + items_table(results, rev) + [""]
    if results["skipped"]:
        lines += ["Skipped (`kind: window_pool`, not a draft recipe): " + ", ".join(results["skipped"]), ""]
    path = os.path.join(out, "step_profile.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def baseline_tree(rev: str, tmp: str) -> tuple[str, str]:
    """``vat/`` of git revision ``rev`` extracted under ``tmp``; returns (label, directory to put on PYTHONPATH)."""
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", REPO, "archive", sha, "vat"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return f"baseline@{sha}", tmp


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="*", default=None, help="recipe files (default: every real-target recipe)")
    parser.add_argument("--tokens", default="256,512,1024", help="comma list of tokens per batch, one cell each")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "step_profile"))
    parser.add_argument("--baseline-rev", default=None, help="also measure with the vat of this git revision")
    parser.add_argument("--force", action="store_true", help="measure cells already in the JSON again")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each cell")
    parser.add_argument("--experts-impl", default="grouped_mm", choices=("grouped_mm", "eager", "batched_mm", "triton"))
    parser.add_argument("--target-dtype", default=None, help="default: the recipe's target.dtype")
    parser.add_argument("--mixed-precision", default=None, choices=("no", "bf16"),
                        help="default: the recipe's train.mixed_precision")
    parser.add_argument("--cell-timeout", type=float, default=3600.0, help="seconds per subprocess")
    parser.add_argument("--max-rss-gb", type=float, default=None, help="kill a subprocess whose RSS passes this")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tokens = sorted({int(t) for t in args.tokens.split(",")})
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    os.makedirs(args.out, exist_ok=True)
    recipes, skipped = list_recipes(args.recipes or [])
    for path in skipped:
        print(f"[step_profile] {path}: kind window_pool (not a draft recipe), skipped", flush=True)
    results = load_results(os.path.join(args.out, "step_profile.json"))
    results["skipped"] = sorted(set(results["skipped"]) | set(skipped))
    with tempfile.TemporaryDirectory(prefix="step-profile-rev-") as tmp:
        revisions = {"current": REPO}
        if args.baseline_rev:
            label, root = baseline_tree(args.baseline_rev, tmp)
            revisions[label] = root
        results["revisions"].update({k: (v if k == "current" else args.baseline_rev) for k, v in revisions.items()})
        for recipe in recipes:
            facts = recipe_facts(os.path.join(REPO, recipe))
            measure_recipe(recipe, facts, revisions, results, args)
            entry = results["recipes"].setdefault(recipe, {"models": {}})
            entry["facts"] = facts
            for rev in revisions:
                model = model_for(recipe, rev, facts, results)
                if model is not None:
                    entry["models"][rev] = model
            save_results(results, args.out)
    any_cell = next(iter(results["cells"].values()), {})
    results["meta"] = {"device": any_cell.get("device"), "threads": any_cell.get("threads"),
                       "torch": any_cell.get("torch"), "cpus": os.cpu_count()}
    save_results(results, args.out)
    path = write_markdown(results, list(revisions), args.out)
    print_summary(results, list(revisions))
    print(f"[step_profile] wrote {os.path.join(args.out, 'step_profile.json')} and {path}")
    return 0


def print_summary(results: dict, revisions: list[str]) -> None:
    for recipe in sorted(results["recipes"]):
        print(f"\n{recipe}")
        print("\n".join(cell_table(recipe, revisions, results)))
    for rev in revisions:
        print(f"\npredicted peak per GPU ({rev})")
        print("\n".join(summary_rows(results, rev)))


if __name__ == "__main__":
    sys.exit(main())
