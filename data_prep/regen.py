"""`vat prep regen`: regenerate every assistant turn with the target, so the draft learns the target's own outputs.

Turn by turn: assistant turn j is generated from the *regenerated* history (user turns kept verbatim), with the
target's chat template and generation prompt, HF ``generate`` in left-padded batches (temperature 0 = greedy).
Output is JSON Lines in ShareGPT layout, ``{"id", "conversations": [{"from", "value"}]}``, appended one batch at a
time; a rerun skips ids already written (a line cut by a killed run is removed first), so it resumes where it stopped.
``OUTPUT.stats.json`` counts what happened (``read == written + already_done + skipped``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter

import torch
from vat.data_prep.chat import normalize_record
from vat.data_prep.readers import ReadStats, iter_records

from vat.errors import VatError, require_file

logger = logging.getLogger(__name__)

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|return|>")
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def done_ids(path: str) -> set[str]:
    """Ids already in an output file; a trailing partial line (killed run) is cut off so appends stay valid."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size:
            f.seek(max(0, size - 1))
            if f.read(1) != b"\n":
                f.seek(0)
                data = f.read()
                keep = data.rfind(b"\n") + 1
                f.truncate(keep)
                logger.warning("removed a partial last line (%d bytes) from %s", size - keep, path)
    return {str(r["id"]) for r in iter_records(path, ReadStats()) if "id" in r}


def stop_token_ids(tokenizer, model) -> list[int]:
    """End-of-sequence ids for generation: the model's and tokenizer's EOS plus the chat end-of-turn tokens."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(i for i in ids if i is not None)


class Regenerator:
    """Batched, turn-by-turn regeneration of assistant turns with a causal LM and its chat template.

    Args:
        model: a transformers causal LM (eval mode).
        tokenizer: its tokenizer (a chat template is required); switched to left padding.
        max_new_tokens: generation budget per turn.
        temperature: 0 = greedy; otherwise sampling at this temperature.
        max_prompt_tokens: a turn whose prompt is longer ends the conversation there (default: the model's
            ``max_position_embeddings`` minus ``max_new_tokens``).
    """

    def __init__(self, model, tokenizer, max_new_tokens: int = 256, temperature: float = 0.0, max_prompt_tokens=None):
        if not getattr(tokenizer, "chat_template", None):
            raise VatError("the target's tokenizer has no chat template")
        self.model, self.tokenizer = model.eval(), tokenizer
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.max_prompt_tokens = max_prompt_tokens or max(1, limit - max_new_tokens)
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.counts: Counter = Counter()

    @torch.no_grad()
    def generate(self, prompts: list[list[dict]]) -> list[tuple[str, bool]]:
        """One assistant reply per chat prefix: ``(text, finished_with_end_of_turn)``. Prompts are left-padded."""
        texts = [self.tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        enc = self.tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        device = next(self.model.parameters()).device
        kwargs = dict(
            max_new_tokens=self.max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=self.tokenizer.pad_token_id
        )
        if self.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        out = self.model.generate(
            input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device), **kwargs
        )  # (B, T_prompt + T_new)
        new = out[:, enc["input_ids"].shape[1] :].cpu()  # (B, T_new)
        results = []
        stop = set(self.stop_ids)
        for row in new.tolist():
            ended = next((i for i, t in enumerate(row) if t in stop), None)
            tokens = row if ended is None else row[:ended]
            results.append((self.tokenizer.decode(tokens, skip_special_tokens=True).strip(), ended is not None))
        return results

    def regenerate(self, conversations: list[list[dict]]) -> list[list[dict]]:
        """Regenerate the assistant turns of a batch of conversations, round by round (turn j of all at once).

        Args:
            conversations: normalised ``[{"role", "content"}]`` lists.

        Returns:
            The regenerated conversations: the same user/system turns, assistant turns replaced. A conversation
            stops before a turn whose prompt is too long or whose reply is empty (counted in ``self.counts``).
        """
        slots = [[j for j, m in enumerate(c) if m["role"] == "assistant"] for c in conversations]
        new = [[] for _ in conversations]  # regenerated messages so far
        cursor = [0] * len(conversations)  # next original message index to copy
        alive = [True] * len(conversations)
        for r in range(max(len(s) for s in slots)):
            batch, prompts = [], []
            for i, conv in enumerate(conversations):
                if not alive[i] or r >= len(slots[i]):
                    continue
                j = slots[i][r]
                new[i].extend(conv[cursor[i] : j])  # the user/system turns before this assistant turn
                cursor[i] = j + 1
                prompt = new[i]
                n_tokens = len(
                    self.tokenizer.apply_chat_template(
                        prompt, tokenize=True, add_generation_prompt=True, return_dict=False
                    )
                )
                if n_tokens > self.max_prompt_tokens:
                    alive[i] = False
                    self.counts["stopped_prompt_too_long"] += 1
                    continue
                batch.append(i)
                prompts.append(prompt)
            if not batch:
                continue
            for i, (text, ended) in zip(batch, self.generate(prompts)):
                self.counts["turns_generated"] += 1
                if not ended:
                    self.counts["turns_hit_max_new_tokens"] += 1
                if not text:
                    alive[i] = False
                    self.counts["stopped_empty_reply"] += 1
                    continue
                new[i].append({"role": "assistant", "content": text})
        # Drop trailing user turns left by a stop: a conversation must end with an assistant turn.
        for msgs in new:
            while msgs and msgs[-1]["role"] != "assistant":
                msgs.pop()
        return new


def to_sharegpt(row_id: str, messages: list[dict]) -> dict:
    """A ShareGPT-layout row: ``{"id", "conversations": [{"from": human|gpt|system, "value"}]}``."""
    return {
        "id": row_id,
        "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages],
    }


def regenerate_file(
    input: str,
    output: str,
    regenerator: Regenerator,
    batch_size: int = 8,
    limit: int | None = None,
    progress: bool = True,
) -> dict:
    """Regenerate the chats of ``input`` into ``output`` (JSON Lines, appended; ids already there are skipped).

    Args:
        input: chat file (JSON array or JSON Lines, any layout ``vat prep chat`` reads).
        output: output ``.jsonl``.
        regenerator: a :class:`Regenerator`.
        batch_size: conversations per generation batch.
        limit: consider only the first ``limit`` input rows (so a resumed run finishes the same set).
        progress: tqdm bar.

    Returns:
        Stats, also written to ``OUTPUT.stats.json``.
    """
    from tqdm.auto import tqdm

    t0 = time.time()
    require_file(input, "input file")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    done = done_ids(output)
    read = ReadStats()
    counts: Counter = Counter()
    pending: list[tuple[str, list[dict]]] = []

    def flush(f) -> None:
        convs = regenerator.regenerate([m for _, m in pending])
        for (row_id, _), msgs in zip(pending, convs):
            if any(m["role"] == "assistant" for m in msgs):
                f.write(json.dumps(to_sharegpt(row_id, msgs), ensure_ascii=False) + "\n")
                counts["written"] += 1
            else:
                counts["skipped_nothing_generated"] += 1
        f.flush()
        bar.update(len(pending))
        pending.clear()

    bar = tqdm(desc="regen", unit=" conv", disable=not progress)
    seen_in_run: set[str] = set()
    with open(output, "a", encoding="utf-8") as f:
        for index, record in enumerate(iter_records(input, read)):
            if limit is not None and index >= limit:
                break
            counts["read"] += 1
            row_id = str(record.get("id", f"row{index}"))
            if row_id in done:
                counts["already_done"] += 1
                continue
            if row_id in seen_in_run:
                counts["skipped_duplicate_id"] += 1
                continue
            messages, reason, _ = normalize_record(record)
            if reason:
                counts[f"skipped_{reason}"] += 1
                continue
            seen_in_run.add(row_id)
            pending.append((row_id, messages))
            if len(pending) >= batch_size:
                flush(f)
        if pending:
            flush(f)
    bar.close()
    counts["read"] += read.malformed_json + read.non_object
    counts["skipped_malformed_json"] += read.malformed_json + read.non_object
    stats = {
        "input": input,
        "output": output,
        **{k: counts[k] for k in ("read", "written", "already_done")},
        "skipped": {k.removeprefix("skipped_"): v for k, v in sorted(counts.items()) if k.startswith("skipped_") and v},
        "generation": dict(regenerator.counts),
        "truncated_tail": read.truncated_tail,
        "max_new_tokens": regenerator.max_new_tokens,
        "temperature": regenerator.temperature,
        "seconds": round(time.time() - t0, 2),
    }
    with open(output + ".stats.json", "w") as fs:
        json.dump(stats, fs, indent=2)
    return stats


def load_generator_model(path: str):
    """The target and its tokenizer for generation (bf16 on GPU, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(path):
        raise VatError(f"target not found: {path}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16 if device == "cuda" else torch.float32
        ).to(device)
    except OSError as err:
        raise VatError(f"cannot load target {path}: {str(err).splitlines()[0]}") from None
    return model, tokenizer


def main(args) -> int:
    """Entry point of ``vat prep regen``."""
    if args.temperature < 0:
        raise VatError("--temperature must be >= 0")
    torch.manual_seed(0)
    model, tokenizer = load_generator_model(args.target)
    regen = Regenerator(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    stats = regenerate_file(args.input, args.output, regen, batch_size=args.batch_size, limit=args.limit)
    skipped = ", ".join(f"{k}={v}" for k, v in stats["skipped"].items()) or "none"
    print(
        f"read {stats['read']}, written {stats['written']}, already done {stats['already_done']}, skipped: {skipped}; "
        f"{stats['generation'].get('turns_generated', 0)} turns in {stats['seconds']} s -> {args.output}"
    )
    return 0
