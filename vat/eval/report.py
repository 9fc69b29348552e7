"""Write an evaluation's outputs: ``eval.json``, ``report.md`` (tables a person reads) and the PNG plots."""

from __future__ import annotations

import os

from vat.eval.plots import write_plots
from vat.export.checkpoint import write_json

MIB = 1024.0 * 1024.0
ACCEPT_COLUMNS = 3  # acceptance-by-position columns shown in the tables


def write_outputs(result: dict, output: str, plots: bool = True) -> dict[str, str]:
    """Write ``eval.json``, ``report.md`` and (``plots``) the PNGs into ``output``; return their paths by name."""
    os.makedirs(output, exist_ok=True)
    paths = {"eval.json": os.path.join(output, "eval.json"), "report.md": os.path.join(output, "report.md")}
    figures: dict[str, str] = {}
    if plots:
        figures = write_plots(result, output)
        paths.update(figures)
    write_json(paths["eval.json"], result)
    with open(paths["report.md"], "w") as f:
        f.write(render_report(result, {k: os.path.basename(v) for k, v in figures.items()}))
    return paths


# ---- formatting -------------------------------------------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _accept(metrics: dict, k: int) -> str:
    cond = metrics["accept_by_position"]["conditional"]
    return _fmt(cond[k]) if k < len(cond) else "–"


def _row(draft: str, budget: str, m: dict) -> str:
    union = m["union_per_round"]
    bytes_tok = m["expert_bytes_per_token"]
    q = m.get("quality") or {}
    cells = [
        draft, budget, _fmt(m["tau"]), _quality(q.get("agreement"), "pct"), _fmt(q.get("first_divergence"), 1),
        _quality(q.get("stepwise_agreement"), "pct"),
        _quality(q.get("kl_to_natural"), "kl"), *[_accept(m, k) for k in range(ACCEPT_COLUMNS)],
        _fmt(m["verified_tokens_per_round"], 1), _fmt(union["mean"], 1), _fmt(union["p90"], 0),
        _fmt(None if bytes_tok is None else bytes_tok / MIB, 3), _fmt(m["target_forwards_per_token"], 3),
        _fmt(m["tokens_per_s"], 1), _fmt(m["speedup_vs_ar"]), str(m["n_prompts"]), str(m["n_rounds"]),
    ]
    return "| " + " | ".join(cells) + " |"


def _quality(value, kind: str) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.1f} %" if kind == "pct" else f"{value:.4f}"


HEADER = (
    "| draft | budget | τ | agreement | 1st divergence | stepwise agreement | KL to natural | " + " | ".join(f"acc@{k + 1}" for k in range(ACCEPT_COLUMNS))
    + " | verified/round | union/layer/round | union p90 | expert MiB/token | target fwd/token | tok/s | speed-up"
    " | prompts | rounds |"
)


def _separator() -> str:
    return "|" + "---|" * (HEADER.count("|") - 1)


def metrics_table(per_config: list[tuple[str, str, dict]]) -> str:
    """A Markdown table with one row per (draft, budget, metrics)."""
    lines = [HEADER, _separator()]
    lines += [_row(d, b, m) for d, b, m in per_config]
    return "\n".join(lines)


def _configs(result: dict, benchmark: str | None) -> list[tuple[str, str, dict]]:
    rows = []
    for draft, per_budget in result["results"].items():
        for budget in per_budget:
            m = result["pooled"][draft][budget] if benchmark is None else per_budget[budget].get(benchmark)
            if m is not None:
                rows.append((draft, budget, m))
    return rows


def category_table(result: dict, benchmark: str) -> str:
    """τ per category (rows) for every draft x budget (columns)."""
    configs = [(d, b, pb[benchmark]) for d, per in result["results"].items() for b, pb in per.items() if benchmark in pb]
    cats = []
    for _, _, m in configs:
        cats += [c for c in m["categories"] if c not in cats]
    head = "| category | " + " | ".join(f"{d} B={b}" for d, b, _ in configs) + " |"
    lines = [head, "|---|" + "---|" * len(configs)]
    for c in cats:
        cells = [_fmt(m["categories"].get(c, {}).get("tau")) for _, _, m in configs]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(result: dict, benchmark: str | None) -> str:
    """The modeled-cost table (``--cost-model``): one row per draft x budget, or '' without a cost model."""
    model = result.get("cost_model")
    if not model:
        return ""
    acc = model["label"]
    lines = [f"| draft | budget | τ | modeled ms/round ({acc}, bytes model) | of which drafting | modeled tok/s | "
             "modeled AR tok/s | modeled speed-up over AR |", "|---|---|---|---|---|---|---|---|"]
    for draft, budget, m in _configs(result, benchmark):
        c = m.get("cost")
        if not c:
            continue
        rounds = m["n_rounds"] or 1
        per_round = None if c["modeled_seconds_per_round"] is None else 1e3 * c["modeled_seconds_per_round"]
        lines.append(f"| {draft} | {budget} | {_fmt(m['tau'])} | {_fmt(per_round, 4)} | "
                     f"{_fmt(1e3 * c['modeled_draft_seconds'] / rounds, 4)} | {_fmt(c['modeled_tokens_per_s'], 0)} | "
                     f"{_fmt(c['modeled_ar_tokens_per_s'], 0)} | {_fmt(c['modeled_speedup_vs_ar'], 3)} |")
    return "\n".join(lines)


def _cost_note(result: dict) -> str:
    model = result["cost_model"]
    eta, latency = model.get("eta", 1.0), model.get("latency_us", 0.0)  # absent: a record before the knobs (pure)
    return (f"A bytes model, on {model['label']} ({model['source']}), weights and KV in {model['served_bytes']}-byte "
            f"elements: each forward takes latency + max(bytes / (η · bandwidth), FLOPs / peak) with η = {eta:g} and "
            f"latency = {latency:g} µs, bytes = dense weights + the executed expert union + KV read; speed-up = "
            "modeled AR time of the same tokens / modeled time (docs/eval.md).")


def offload_table(result: dict, benchmark: str | None) -> str:
    """The expert-offloading table (``--offload``): one row per draft x budget x cache size, or '' without it."""
    spec = result.get("offload")
    if not spec:
        return ""
    acc = result["cost_model"]["label"]
    lines = [f"| draft | budget | C | τ | hit rate | H2D MiB/token | AR H2D MiB/token | modeled tok/s under offload "
             f"({acc}, bytes model) | modeled speed-up over AR under offload |", "|---|---|---|---|---|---|---|---|---|"]
    for draft, budget, m in _configs(result, benchmark):
        for size, o in (m.get("offload") or {}).items():
            mib = [None if o[k] is None else o[k] / MIB for k in ("h2d_bytes_per_token", "ar_h2d_bytes_per_token")]
            lines.append(f"| {draft} | {budget} | {size} | {_fmt(m['tau'])} | {_quality(o['hit_rate'], 'pct')} | "
                         f"{_fmt(mib[0], 3)} | {_fmt(mib[1], 3)} | {_fmt(o['modeled_offload_tokens_per_s'], 0)} | "
                         f"{_fmt(o['modeled_offload_speedup_vs_ar'], 3)} |")
    return "\n".join(lines)


def _offload_note(result: dict) -> str:
    spec = result["offload"]
    return (f"Expert offloading: C resident experts per MoE layer ({spec['policy'].upper()} eviction, the cache warm), "
            f"the rest in host memory over {spec['link_label']} ({spec['link_bytes_per_s'] / 1e9:g} GB/s per "
            "direction); a forward's misses cross the link before it runs (modeled time = the bytes model's + H2D "
            "bytes / link bandwidth); AR = the same tokens one forward each (docs/eval.md \"Expert offloading\").")


def markdown_summary(result: dict) -> str:
    """The pooled table plus one table per benchmark (what `vat eval` prints)."""
    parts = ["All benchmarks pooled:", "", metrics_table(_configs(result, None))]
    if result.get("cost_model"):
        parts += ["", _cost_note(result), "", cost_table(result, None)]
    if result.get("offload"):
        parts += ["", _offload_note(result), "", offload_table(result, None)]
    for name in result["benchmarks"]:
        parts += ["", f"{name}:", "", metrics_table(_configs(result, name))]
    return "\n".join(parts)


def _draft_origin(draft: dict, steps: int) -> str:
    """Where a draft came from, for the report's header."""
    if draft.get("free_draft") == "suffix":
        return (f"training-free suffix decoding, depth {draft['max_depth']}, "
                f"{'with' if draft.get('use_global', True) else 'without'} the pass's earlier responses, chain K={steps}")
    if draft.get("mode") == "ngram":
        rule = {"vllm": "vLLM's rule (earliest occurrence)", "recent": "recent occurrence"}[draft.get("rule", "recent")]
        return (f"training-free n-gram prompt lookup, {rule}, n = {draft['n_max']}..{draft['n_min']}, "
                f"chain K={steps}")
    if draft.get("path"):
        return draft["path"]
    return "autoregressive baseline" if draft.get("mode") == "ar" else "in-memory draft"


def example_block(example: dict, max_chars: int = 600) -> str:
    """One decoded answer (the first prompt, the first configuration), so a reader sees what was being predicted."""
    question = " ".join(example["question"].split())
    question = question if len(question) <= 200 else question[:200] + " …"
    answer = example["answer"] if len(example["answer"]) <= max_chars else example["answer"][:max_chars] + " …"
    return "\n".join([
        f"Example: the first prompt and the answer of `{example['draft']}` at budget {example['budget']}:",
        "",
        f"> {question}",
        "",
        "```text",
        answer.replace("```", "` ` `"),
        "```",
    ])


def render_report(result: dict, figures: dict[str, str] | None = None) -> str:
    """The full ``report.md``."""
    s = result["settings"]
    info = result["target_info"]
    tree = s["tree"]
    drafting = (f"dynamic tree top_k={tree['top_k']} depth={tree['depth']} total_tokens={tree['total_tokens']}"
                if tree else f"chain K={s['steps']}")
    lines = [
        "# vat eval report",
        "",
        f"- target: `{result['target']}` ({info['num_experts']} experts, top-{info['top_k']}, "
        f"{len(info['moe_layer_ids'])} MoE layers, {info['dtype']} on {info['device']})",
        f"- drafting: {drafting}; temperature {s['temperature']}; budgets {s['budgets']} (policy {s['policy']}); "
        f"vh threshold {s['vh_threshold']}; tree policy {s.get('tree_policy', 'confidence')}"
        + (f"; draft confidence stop {s['draft_confidence']}" if s.get("draft_confidence") is not None else ""),
        f"- max new tokens {s['max_new_tokens']} per turn; limit {s['limit']} prompts per benchmark; batch size 1; "
        f"seed {s['seed']}; {result['seconds']:.0f} s in all",
        "- drafts: " + ", ".join(f"`{k}` ({_draft_origin(v, s['steps'])})" for k, v in result["drafts"].items()),
        "",
        "τ = tokens committed per verification round (accepted drafts + 1); acc@k = P(draft k accepted | position k "
        "reached); union = distinct experts executed per MoE layer per verification forward (routing captured from "
        "the forward itself); speed-up = tokens/s over the autoregressive baseline measured in the same run. "
        "A budgeted target is another model, so every budgeted row carries its quality: agreement = per-token "
        "agreement of its output with the natural greedy output of the same prompt, 1st divergence = tokens until "
        "they first differ (mean per turn), stepwise agreement = share of its tokens the natural target picks greedily "
        "after the same prefix (teacher-forced on its own output: no cascade after a divergence), KL to natural = KL(budgeted ‖ natural) of the next-token distribution "
        "on the target's own text, nats per token (prompt prefilled unbudgeted, response in verification-block "
        "windows). Definitions: docs/eval.md.",
        "",
        "## All benchmarks pooled",
        "",
        metrics_table(_configs(result, None)),
    ]
    if result.get("cost_model"):
        lines += ["", "### Modeled cost", "", _cost_note(result), "", cost_table(result, None)]
    if result.get("offload"):
        lines += ["", "### Expert offloading", "", _offload_note(result), "", offload_table(result, None)]
    for name in result["benchmarks"]:
        skipped = result["skipped"].get(name, {}).get("too_long", 0)
        lines += ["", f"## {name}", ""]
        if skipped:
            lines += [f"{skipped} prompt(s) skipped: too long for the target's positions.", ""]
        ref = result.get("quality_reference", {}).get(name)
        if ref:
            extra = f", {ref['seconds']:.1f} s extra" if ref["seconds"] else ""
            lines += [f"Quality reference: {ref['source']}{extra}.", ""]
        lines += [metrics_table(_configs(result, name))]
        if name in result.get("examples", {}):
            lines += ["", example_block(result["examples"][name])]
        if result.get("cost_model"):
            lines += ["", "Modeled cost:", "", cost_table(result, name)]
        if result.get("offload"):
            lines += ["", "Expert offloading:", "", offload_table(result, name)]
        lines += ["", "τ per category:", "", category_table(result, name)]
    if figures:
        lines += ["", "## Figures", ""]
        lines += [f"![{title}]({path})" for title, path in figures.items()]
    return "\n".join(lines) + "\n"
