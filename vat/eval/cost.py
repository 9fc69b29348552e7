"""A roofline cost model: the modeled time of speculative decoding on a named accelerator (docs/eval.md "cost").

CPU wall time says nothing about how a draft would do on the GPUs these targets are served on, so every round the
engine ran is also priced on an accelerator from its data sheet. One forward of ``T`` tokens over a context of ``n``
cached positions takes

    t = max(bytes / HBM bandwidth, FLOPs / dense bf16 peak)

with, in the served dtype (bf16 unless asked otherwise, whatever dtype the CPU evaluation ran in):

* bytes = the dense (non-routed-expert) weights once + Σ_l U_l · e_l (the union of experts the forward executed in
  each MoE layer times one expert's weights, the eval's own ``round_bytes`` accounting re-priced) + the KV cache read,
  (n + T) · kv_per_token over the layers that attend to the whole context plus min(n + T, W + T) · the windowed
  layers' KV for sliding-window layers of window W (:func:`attention_terms`: MLA's latent cache for DeepSeek-V3);
* FLOPs = T · (2 · dense matmul parameters + 2 · k · Σ_l e_l) + T · (n + T) · attention FLOPs per query per key.

A verification round costs its draft forwards (each a forward of the draft: its parameters once, its KV, its FLOPs;
:func:`draft_forwards` says how many a round ran) plus the target's verification forward. An autoregressive step is
the same target forward with T = 1 and U_l = k. The modeled speed-up over AR of a decode is the modeled time of
generating the same tokens autoregressively (one step per token after the prefill's, at the same contexts) over the
modeled time of its rounds; the prefill is left out of both (it is the same forward either way).

It is a bytes model: a forward's time follows the bytes it moves (and its FLOPs when those dominate). Two knobs make
it less ideal, both off in the plain presets (``h200``: η = 1, no fixed latency) and set with ``name@key=value,...``
(:func:`get_accelerator`): an achievable-bandwidth factor η (bytes move at η · the data-sheet bandwidth) and a fixed
latency per forward (launches, synchronisation, the framework), added to every forward, the draft's included:

    t = latency + max(bytes / (η · HBM bandwidth), FLOPs / dense bf16 peak)

Assumptions (docs/eval.md "Cost model"): every byte is read from HBM once per forward (no cache reuse across
forwards), compute and memory overlap perfectly inside a forward, batch size 1, the input embedding reads only the T
rows it looks up (the LM head reads all of it). The model ranks configurations; it does not promise absolute tokens/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from vat.errors import VatError

SERVED_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


@dataclass(frozen=True)
class Accelerator:
    """One accelerator's roofline: HBM bandwidth and dense (no sparsity) bf16 tensor-core peak.

    Attributes:
        name: the ``--cost-model`` key.
        label: a readable name.
        hbm_bytes_per_s: memory bandwidth, bytes/s.
        bf16_flops_per_s: dense bf16 peak, FLOP/s.
        source: where the figures come from.
        eta: achievable-bandwidth factor η in (0, 1]: bytes move at η · ``hbm_bytes_per_s`` (1 = the data sheet).
        latency_us: fixed microseconds every forward costs on top of its roofline time (0 = none).
    """

    name: str
    label: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    source: str
    eta: float = 1.0
    latency_us: float = 0.0

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a forward is compute bound (at the achievable bandwidth)."""
        return self.bf16_flops_per_s / (self.eta * self.hbm_bytes_per_s)

    @property
    def pure_bytes(self) -> bool:
        """Whether this is the plain data-sheet roofline (η = 1, no fixed latency)."""
        return self.eta == 1.0 and self.latency_us == 0.0


# Data-sheet figures. NVIDIA quotes bf16 tensor-core peaks "with sparsity"; the dense figure is half of it.
ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 80 GB: HBM3 3.35 TB/s; BF16 Tensor Core 1,979 TFLOPS with sparsity.
    "h100": Accelerator("h100", "H100 SXM 80GB", 3.35e12, 989.5e12,
                        "NVIDIA H100 datasheet (SXM): 3.35 TB/s HBM3, 1979 TFLOPS bf16 with sparsity = 989.5 dense"),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM 141 GB: HBM3e 4.8 TB/s; BF16 Tensor Core 1,979 TFLOPS with sparsity.
    "h200": Accelerator("h200", "H200 SXM 141GB", 4.8e12, 989.5e12,
                        "NVIDIA H200 datasheet (SXM): 4.8 TB/s HBM3e, 1979 TFLOPS bf16 with sparsity = 989.5 dense"),
    # NVIDIA A100 Tensor Core GPU datasheet, 80 GB SXM: HBM2e 2,039 GB/s; BF16 Tensor Core 312 TFLOPS (624 sparse).
    "a100": Accelerator("a100", "A100 SXM 80GB", 2.039e12, 312e12,
                        "NVIDIA A100 datasheet (80GB SXM): 2039 GB/s HBM2e, 312 TFLOPS bf16 dense"),
    # NVIDIA L40S datasheet: GDDR6 864 GB/s; BF16 Tensor Core 362.05 TFLOPS (733 with sparsity).
    "l40s": Accelerator("l40s", "L40S 48GB", 864e9, 362.05e12,
                        "NVIDIA L40S datasheet: 864 GB/s GDDR6, 362.05 TFLOPS bf16 dense"),
}
ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "a100-80gb": "a100", "a100-sxm": "a100"}

# The two knobs of ``name@key=value,...`` and the value a key given without ``=value`` takes (docs/eval.md "Cost
# model" gives the public figures behind them): η = 0.8, the ~78 % of peak a profile of MLP weight loads on an H100
# reports; 10 µs per forward, a CUDA-graph replay of one decode step (one launch, ~5 µs of host time, plus the gaps
# between its kernels). Until `benchmarks/moe_kernel.py` has measured η on the GPU (its "% peak" column), these are
# assumptions, not measurements.
COST_KNOBS = {"eta": 0.8, "latency_us": 10.0}


def _knobs(spec: str, text: str) -> dict[str, float]:
    """``eta=0.8,latency_us=10`` -> the knobs' values (a bare key = its documented default); one line on bad input."""
    out: dict[str, float] = {}
    for part in text.split(","):
        key, eq, value = (x.strip().lower() for x in part.partition("="))
        if key not in COST_KNOBS or key in out:
            what = "repeated" if key in out else "unknown"
            raise VatError(f"cost model `{spec}`: {what} knob `{key}` (knobs: eta in (0, 1], latency_us >= 0; "
                           "e.g. h200@eta=0.8,latency_us=10)")
        try:
            out[key] = float(value) if eq else COST_KNOBS[key]
        except ValueError:
            raise VatError(f"cost model `{spec}`: `{key}` takes a number, got `{value}`") from None
    if not 0 < out.get("eta", 1.0) <= 1:
        raise VatError(f"cost model `{spec}`: eta must be in (0, 1], got {out['eta']:g}")
    if out.get("latency_us", 0.0) < 0:
        raise VatError(f"cost model `{spec}`: latency_us must be >= 0, got {out['latency_us']:g}")
    return out


def get_accelerator(name: str) -> Accelerator:
    """The accelerator ``name`` names (case-insensitive): a preset (``h200``: the pure bytes model, η = 1, no fixed
    latency), or a preset with knobs, ``h200@eta=0.8,latency_us=10`` (a bare ``eta`` / ``latency_us`` takes its
    documented default, :data:`COST_KNOBS`). The returned accelerator's ``name`` is the canonical spelling.

    Raises:
        VatError: an unknown name, knob or bad value, in one line.
    """
    spec = str(name).strip()
    base, at, knobs = spec.partition("@")
    key = base.strip().lower()
    key = ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise VatError(f"unknown cost model `{name}`: known accelerators are {', '.join(ACCELERATORS)} "
                       "(knobs: `h200@eta=0.8,latency_us=10`)")
    if not at:
        return ACCELERATORS[key]
    values = _knobs(spec, knobs)
    eta, latency_us = values.get("eta", 1.0), values.get("latency_us", 0.0)
    acc = ACCELERATORS[key]
    return replace(acc, name=f"{key}@eta={eta:g},latency_us={latency_us:g}", eta=eta, latency_us=latency_us,
                   label=f"{acc.label}, η {eta:g}, {latency_us:g} µs/forward")


@dataclass
class ModelShape:
    """What the roofline needs to know of a model (a target, or a draft), in parameter and element counts.

    Attributes:
        dense_params: parameters every forward reads once (everything but the routed experts and an untied input
            embedding; a draft's: its own parameters plus any target table it reads in full, e.g. DFlash's LM head).
        dense_matmul_params: parameters a token multiplies through outside the routed experts (FLOPs = 2 each).
        expert_params: one routed expert's parameters in each MoE layer, length L' (empty for a dense draft).
        top_k: experts per token.
        kv_per_token: KV-cache elements per cached position, summed over the layers that attend to the whole context
            (:func:`attention_terms`: 2 · kv_heads · head_dim per layer; MLA's compressed latent for DeepSeek-V3).
        attn_flops_per_key: attention FLOPs per query per key over those layers (4 · heads · head_dim per layer).
        window: the sliding window of the windowed layers (0: none), whose keys are at most ``window + T``.
        window_kv_per_token: KV elements per cached position summed over the windowed layers.
        window_attn_flops_per_key: attention FLOPs per query per key over the windowed layers.
    """

    dense_params: int
    dense_matmul_params: int
    expert_params: list[int]
    top_k: int
    kv_per_token: int
    attn_flops_per_key: int
    window: int = 0
    window_kv_per_token: int = 0
    window_attn_flops_per_key: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelShape:
        """A shape as recorded (a record written before the windowed terms existed has none)."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def attention_terms(config) -> dict[str, int]:
    """KV-cache elements per cached position and attention FLOPs per query per key of a transformers / vat config.

    Returns the attention side of :class:`ModelShape` as a dict of its five keys: ``kv_per_token`` and
    ``attn_flops_per_key`` (the layers that attend to the whole context), ``window`` (0: no windowed layers),
    ``window_kv_per_token`` and ``window_attn_flops_per_key`` (the sliding-window layers).

    * Multi-head / grouped-query attention: per layer 2 · kv_heads · head_dim KV elements (K and V) and
      4 · heads · head_dim FLOPs per key (QKᵀ and AV, 2 FLOPs per multiply-add).
    * Multi-head latent attention (DeepSeek-V3: ``kv_lora_rank`` set): the cache holds the compressed latent and the
      decoupled RoPE key, ``kv_lora_rank + qk_rope_head_dim`` elements per layer (576 for DeepSeek-V3; its
      128 heads' K and V uncompressed would be 128 · (192 + 128) = 40,960); decoding attends in the latent space (the up-projections absorbed into
      the query and output), 2 · heads · (kv_lora_rank + qk_rope_head_dim) FLOPs for the scores and
      2 · heads · kv_lora_rank for the values per key.
    * Sliding-window layers (``layer_types`` entries ``sliding_attention`` with ``sliding_window`` W, as GPT-OSS
      alternates): their own terms, priced over at most W + T keys (:func:`forward_cost`).
    """
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    heads = int(config.num_attention_heads)
    latent = getattr(config, "kv_lora_rank", None)
    if latent:
        rope = int(getattr(config, "qk_rope_head_dim", 0) or 0)
        kv, flops = int(latent) + rope, 2 * heads * (int(latent) + rope) + 2 * heads * int(latent)
    else:
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv, flops = 2 * kv_heads * head_dim, 4 * heads * head_dim
    kinds = list(getattr(config, "layer_types", None) or [])[:layers]
    window = int(getattr(config, "sliding_window", None) or 0)
    windowed = sum(kind == "sliding_attention" for kind in kinds) if window else 0
    full = layers - windowed
    return {"kv_per_token": full * kv, "attn_flops_per_key": full * flops, "window": window if windowed else 0,
            "window_kv_per_token": windowed * kv, "window_attn_flops_per_key": windowed * flops}


def target_shape(target) -> ModelShape:
    """The :class:`ModelShape` of a :class:`vat.target.FrozenTarget` (from its parameters, not its dtype)."""
    model = target.model
    expert_params, routed = [], 0
    for _, _, experts in target.routing.moe_layers:
        one = 0
        for name, param in experts.named_parameters(recurse=False):
            if param.dim() >= 2 or name.endswith("bias"):
                one += param.numel() // param.shape[0]
                routed += param.numel()
        expert_params.append(one)
    total = sum(p.numel() for p in model.parameters())
    embed = target.embed_tokens().weight
    head = target.lm_head().weight
    untied_embedding = embed.numel() if embed.data_ptr() != head.data_ptr() else 0
    dense = total - routed - untied_embedding
    return ModelShape(dense_params=dense, dense_matmul_params=dense, expert_params=expert_params,
                      top_k=int(target.top_k), **attention_terms(target.config))


def draft_shape(drafter) -> ModelShape | None:
    """The :class:`ModelShape` of an EAGLE-3 or DFlash draft (None for no draft / the n-gram lookup).

    The draft's registered parameters (the frozen target embedding it borrows is not one of them: a draft step reads
    only the rows it looks up) plus, for DFlash, the target's LM head it projects through.
    """
    if drafter is None or not hasattr(drafter, "parameters"):
        return None
    params = sum(p.numel() for p in drafter.parameters())
    lm_head = getattr(drafter, "lm_head", None)
    if lm_head is not None and not any(lm_head is m for m in drafter.modules()):  # a borrowed (unregistered) head
        params += int(lm_head.weight.numel())
    return ModelShape(dense_params=params, dense_matmul_params=params, expert_params=[], top_k=0,
                      **attention_terms(drafter.config))


def forward_cost(shape: ModelShape, tokens: int, context: int, union: Sequence[int] | None,
                 served_bytes: int = 2) -> tuple[float, float]:
    """Bytes and FLOPs of one forward of ``tokens`` new positions over ``context`` cached ones.

    Args:
        shape: the model.
        tokens: T, positions in the forward (the verification block).
        context: n, positions already in the KV cache.
        union: U_l, experts executed per MoE layer (None = a dense model, or no expert reads counted).
        served_bytes: bytes per weight / KV element in the served dtype.

    Returns:
        ``(bytes, flops)``.
    """
    keys = context + tokens
    window_keys = min(keys, shape.window + tokens) if shape.window else 0  # a sliding-window layer's keys
    expert_reads = sum(u * e for u, e in zip(union or [], shape.expert_params))
    weight_bytes = (shape.dense_params + expert_reads) * served_bytes
    kv_bytes = (keys * shape.kv_per_token + window_keys * shape.window_kv_per_token) * served_bytes
    flops = tokens * (2 * shape.dense_matmul_params + 2 * shape.top_k * sum(shape.expert_params))
    flops += tokens * (keys * shape.attn_flops_per_key + window_keys * shape.window_attn_flops_per_key)
    return float(weight_bytes + kv_bytes), float(flops)


def roofline_seconds(acc: Accelerator, nbytes: float, flops: float) -> float:
    """latency + max(bytes / (η · bandwidth), FLOPs / peak) (the plain presets: η = 1, latency 0)."""
    return acc.latency_us * 1e-6 + max(nbytes / (acc.eta * acc.hbm_bytes_per_s), flops / acc.bf16_flops_per_s)


def verify_seconds(acc: Accelerator, shape: ModelShape, tokens: int, context: int, union: Sequence[int],
                   served_bytes: int = 2) -> float:
    """Modeled time of one target forward (a verification block, or an AR step with T = 1 and U_l = k)."""
    return roofline_seconds(acc, *forward_cost(shape, tokens, context, union, served_bytes))


def draft_forwards(mode: str, depth: int, top_k: int = 1) -> list[int]:
    """The draft forwards one round runs, as the positions each processes.

    chain: the extension by the newly committed positions (counted as 1 position) then ``depth - 1`` steps of one
    position (the last drafted token needs no step); tree: the extension, then ``depth - 1`` expansions of up to
    ``top_k`` nodes each; block (DFlash): one forward of the whole block (``depth + 1`` positions); ngram / ar: none.
    """
    if mode in ("chain", "tree"):
        width = top_k if mode == "tree" else 1
        return [1] + [width] * max(depth - 1, 0)
    if mode == "block":
        return [depth + 1]
    return []


@dataclass
class CostModel:
    """A target (and a draft) priced on one accelerator in one served dtype.

    Attributes:
        accelerator: the roofline.
        target: the target's shape.
        served_bytes: bytes per element in the served dtype.
    """

    accelerator: Accelerator
    target: ModelShape
    served_bytes: int = 2

    def verify(self, tokens: int, context: int, union: Sequence[int]) -> float:
        return verify_seconds(self.accelerator, self.target, tokens, context, union, self.served_bytes)

    def ar_step(self, context: int) -> float:
        """One autoregressive step at ``context`` cached positions (U_l = k in every MoE layer)."""
        return self.verify(1, context, [self.target.top_k] * len(self.target.expert_params))

    def draft(self, draft: ModelShape | None, widths: Sequence[int], context: int) -> float:
        """Modeled time of the draft forwards of one round (``widths``: positions per forward)."""
        if draft is None:
            return 0.0
        total = 0.0
        for width in widths:
            total += roofline_seconds(self.accelerator, *forward_cost(draft, width, context, None, self.served_bytes))
        return total

    def generation(self, gen, mode: str, draft: ModelShape | None, tree_top_k: int = 1) -> dict[str, float]:
        """Modeled seconds of one decoded turn and of generating its tokens autoregressively.

        Args:
            gen: a :class:`vat.eval.engine.Generation`.
            mode: the engine's mode (``ar``, ``chain``, ``tree``, ``block``, ``ngram``).
            draft: the draft's shape (None for AR / n-gram).
            tree_top_k: the tree's top_k (tree expansions run that many nodes).

        Returns:
            ``modeled_seconds`` (Σ over rounds of the draft's forwards + the verification forward),
            ``modeled_draft_seconds``, ``modeled_ar_seconds`` (one AR step per token after the first, at the same
            contexts).
        """
        context = gen.prompt_tokens
        spent = drafting = 0.0
        for r in gen.rounds:
            ran = r.depth if getattr(r, "drafted_depth", -1) < 0 else r.drafted_depth  # before EVICT's cut
            t_draft = self.draft(draft, draft_forwards(mode, ran, tree_top_k), context)
            spent += t_draft + self.verify(r.drafted + 1, context, r.union)
            drafting += t_draft
            context += r.accepted + 1
        steps = len(gen.token_ids) - 1  # the first token comes from the prefill
        ar = sum(self.ar_step(gen.prompt_tokens + i) for i in range(steps))
        return {"modeled_seconds": spent, "modeled_draft_seconds": drafting, "modeled_ar_seconds": ar}

    def describe(self) -> dict:
        """The ``cost_model`` record of eval.json."""
        acc = self.accelerator
        return {"accelerator": acc.name, "label": acc.label, "kind": "bytes model",
                "hbm_bytes_per_s": acc.hbm_bytes_per_s, "bf16_flops_per_s": acc.bf16_flops_per_s,
                "eta": acc.eta, "latency_us": acc.latency_us, "source": acc.source,
                "served_bytes": self.served_bytes, "target_shape": self.target.to_dict()}


def served_bytes_of(dtype: str) -> int:
    """Bytes per element of a served dtype name (``bfloat16``, ``float16``, ``float32``, ``fp8``)."""
    key = str(dtype).replace("torch.", "").lower()
    if key not in SERVED_BYTES:
        raise VatError(f"unknown served dtype `{dtype}`: one of {', '.join(SERVED_BYTES)}")
    return SERVED_BYTES[key]


def modeled_metrics(counts: dict) -> dict:
    """The ``cost`` metrics of a set of turns from their summed ``modeled_*`` seconds and ``kept`` tokens.

    ``modeled_tokens_per_s`` = kept tokens / modeled seconds; ``modeled_speedup_vs_ar`` = modeled AR seconds of the
    same tokens / modeled seconds (a ratio of sums over turns, like τ).
    """
    spent, ar, kept = counts["modeled_seconds"], counts["modeled_ar_seconds"], counts["kept"]
    return {
        "modeled_seconds": spent,
        "modeled_draft_seconds": counts["modeled_draft_seconds"],
        "modeled_ar_seconds": ar,
        "modeled_tokens_per_s": kept / spent if spent else None,
        "modeled_ar_tokens_per_s": kept / ar if ar else None,
        "modeled_speedup_vs_ar": ar / spent if spent else None,
    }


COST_KEYS = ("modeled_seconds", "modeled_draft_seconds", "modeled_ar_seconds")


def add_costs(model: CostModel, engine, runs, metrics: dict, entries: list[dict]) -> None:
    """Price one configuration's decoded prompts: each ``per_prompt`` entry gets its ``modeled_*`` seconds (summed
    over turns) and ``metrics`` gets ``cost`` (:func:`modeled_metrics` over all of them).

    Args:
        model: the cost model.
        engine: the :class:`vat.eval.engine.SpeculativeEngine` that decoded them (its mode, draft and tree).
        runs: the :class:`vat.eval.metrics.PromptRun` list, in ``entries``' order.
        metrics: the configuration's metrics on this benchmark.
        entries: its ``per_prompt`` entries (``kept`` and ``rounds`` already counted).
    """
    mode = engine.mode
    draft = draft_shape(engine.drafter) if mode in ("chain", "tree", "block") else None
    top_k = engine.tree.top_k if engine.tree is not None else 1
    for run, entry in zip(runs, entries):
        per_turn = [model.generation(g, mode, draft, top_k) for g in run.turns]
        entry.update({k: sum(t[k] for t in per_turn) for k in COST_KEYS})
    metrics["cost"] = pooled_cost(entries)


def pooled_cost(entries: list[dict]) -> dict:
    """:func:`modeled_metrics` of ``per_prompt`` entries (any set: a benchmark, or every benchmark pooled)."""
    totals = {k: sum(float(e[k]) for e in entries) for k in COST_KEYS}
    totals["kept"] = sum(e["kept"] for e in entries)
    out = modeled_metrics(totals)
    rounds = sum(e["rounds"] for e in entries)
    out["modeled_seconds_per_round"] = out["modeled_seconds"] / rounds if rounds else None
    return out
