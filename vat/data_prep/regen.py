"""`vat prep regen`: regenerate assistant turns with the target, so the draft learns the target's own outputs.

Turn by turn: assistant turn j is generated from the *regenerated* history (user turns kept verbatim), with the
target's chat template and generation prompt (temperature 0 = greedy). Fast path (what makes it usable on a CPU):

* conversations are read in pools (``pool_size``); within a pool, the turns ready to generate are **sorted by prompt
  length** and cut into batches of ``batch_size``, so a left-padded batch pads little. Output order and ids are the
  input's (a pool is written in input order), so resuming by id is unaffected;
* a plain KV-cached decode loop (``torch.inference_mode``) that **drops finished rows** from the batch and its cache
  as soon as they emit an end-of-turn token (HF ``generate`` keeps computing them until the slowest row ends), over
  a KV cache **preallocated** for the batch (:func:`preallocated_cache`: transformers' ``DynamicCache`` copies
  itself at every step, more than half of a CPU decode step at batch 32);
* ``max_prompt_tokens`` caps the history: a conversation *ends before* the first assistant turn whose prompt is
  longer (the history is never cut, so every regenerated turn saw exactly the context it is trained with);
  ``max_turns`` keeps only the first K assistant turns.

A reply that reaches ``max_new_tokens`` without an end-of-turn token is written with ``"truncated": true``;
``vat prep chat`` then leaves that turn's end-of-turn token out of the loss (the target never produced it).
Output is JSON Lines in ShareGPT layout, ``{"id", "conversations": [{"from", "value"[, "truncated"]}]}``, appended
one pool at a time; a rerun skips ids already written (a line cut by a killed run is removed first), so it resumes
where it stopped. ``OUTPUT.stats.json`` counts what happened (``read == written + already_done + skipped``) and the
throughput (``new_tokens_per_second``, ``conversations_per_second``).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicLayer

from vat.data_prep.chat import normalize_record
from vat.data_prep.readers import ReadStats, iter_records
from vat.errors import VatError, require_file
from vat.target.cache import cache_kwargs, new_cache
from vat.target.model import resolve_target_path

logger = logging.getLogger(__name__)

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|return|>")
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}
DEFAULT_BATCH_SIZE = 64  # rows per decode batch: a CPU decode step is mostly fixed overhead, so wide batches pay
PREFILL_SLACK = 1.1  # a prefill group may carry at most 10 % padding
DEFAULT_POOL_BATCHES = 4  # conversations per pool = this x batch_size (length-bucketing scope; resume granularity)


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


def preallocated_cache(config, capacity: int):
    """A ``DynamicCache`` whose full-attention layers write into buffers preallocated for ``capacity`` positions.

    transformers' ``DynamicLayer`` grows by ``torch.cat`` at every step, i.e. it copies the whole cache once per
    generated token: on CPU that copy was more than half of a decode step of the tiny target at batch 32 (profiled).
    Here a step writes its new keys/values in place and attention reads a view of the filled prefix (the same
    values, so the same numbers). Sliding-window layers keep transformers' own class.
    """
    class PreallocatedLayer(DynamicLayer):
        def __init__(self):
            super().__init__()
            self.length = 0

        def lazy_initialization(self, key_states, value_states):
            batch, heads, _, dim = key_states.shape
            self.device = key_states.device
            self.key_buffer = key_states.new_empty(batch, heads, capacity, dim)  # (B, H_kv, S_max, hd)
            self.value_buffer = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > capacity:
                raise RuntimeError(f"preallocated KV cache overflow: {end} > {capacity} positions")
            self.key_buffer[:, :, self.length : end] = key_states
            self.value_buffer[:, :, self.length : end] = value_states
            self.length = end
            self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices):
            if self.is_initialized:
                self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
                self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

        def write_rows(self, rows, batch: int, width: int, key_states, value_states):
            """Place rows prefilled elsewhere (or moved from another cache), right-aligned to ``width`` (left
            padding), into a batch of ``batch`` rows. Their padding is zeroed: masked, and finite so that the
            attention's zero weights stay zero."""
            if not self.is_initialized:
                heads, dim = key_states.shape[1], key_states.shape[-1]
                self.device = key_states.device
                self.key_buffer = key_states.new_empty(batch, heads, capacity, dim)  # (B, H_kv, S_max, hd)
                self.value_buffer = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
                self.is_initialized = True
            start = width - key_states.shape[-2]
            self.key_buffer[rows, :, start:width] = key_states
            self.value_buffer[rows, :, start:width] = value_states
            if start:
                self.key_buffer[rows, :, :start] = 0
                self.value_buffer[rows, :, :start] = 0
            self.length = width
            self.keys, self.values = self.key_buffer[:, :, :width], self.value_buffer[:, :, :width]

    cache = new_cache(config)
    cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _refillable(cache) -> bool:
    """Whether rows can join ``cache`` mid-generation (every layer is a preallocated full-attention layer)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(hasattr(layer, "write_rows") for layer in layers)


class Regenerator:
    """Batched, turn-by-turn regeneration of assistant turns with a causal LM and its chat template.

    Args:
        model: a transformers causal LM (eval mode).
        tokenizer: its tokenizer (a chat template is required).
        max_new_tokens: generation budget per turn; a reply that reaches it is marked truncated.
        temperature: 0 = greedy; otherwise sampling at this temperature (no top-k / top-p).
        max_prompt_tokens: a conversation ends before the first assistant turn whose prompt (history + generation
            prompt) is longer (default: the model's ``max_position_embeddings`` minus ``max_new_tokens``).
        max_turns: regenerate at most this many assistant turns per conversation (the rest is dropped; default all).
        batch_size: rows per decode batch (prompts of similar length are batched together).
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        max_prompt_tokens: int | None = None,
        max_turns: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise VatError("the target's tokenizer has no chat template")
        if max_new_tokens < 1 or batch_size < 1 or (max_turns is not None and max_turns < 1):
            raise VatError("max_new_tokens, batch_size and max_turns must be >= 1")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_id is None:
            self.pad_id = 0  # padded positions are masked out; any id will do
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.max_prompt_tokens = max_prompt_tokens or max(1, limit - max_new_tokens)
        self.max_turns = max_turns
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.counts: Counter = Counter()  # turns_generated, turns_truncated, new_tokens, stopped_*, ...

    # ------------------------------------------------------------------------------------------------ tokens

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prefix rendered with the chat template and the generation prompt."""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]  # drop our own keys (truncated)
        text = self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        # verbose=False: a prompt past the tokenizer's model_max_length is expected here (it is measured and the
        # conversation ends before it, max_prompt_tokens), so transformers' too-long warning would be noise
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def generate_ids(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        """Greedy (or sampled) continuations of token-id prompts, KV-cached, at most ``batch_size`` rows at a time.

        Args:
            prompts: lists of token ids (any number).

        Returns:
            Per prompt, in order, ``(new_ids, ended)``: the generated ids before the stop token, and whether a stop
            token was generated (``False`` = cut at ``max_new_tokens``, i.e. truncated).
        """
        results: list = [None] * len(prompts)

        def done(key, new_ids, ended):
            results[key] = (new_ids, ended)

        self.run(list(enumerate(prompts)), done)
        return results

    @torch.inference_mode()
    def run(self, prompts: list[tuple], on_done) -> None:
        """The decode loop: generate a reply for every ``(key, prompt_ids)``; ``on_done(key, new_ids, ended)`` gets
        each one as soon as it is finished and may return the next prompt for that key (a conversation's next
        turn), which joins the queue.

        Continuous batching: queued prompts are admitted shortest first; a row is finished as soon as it emits a
        stop token or reaches ``max_new_tokens``, and once a quarter of the batch is free the next prompts are
        prefilled and join it. All rows stay right-aligned in one left-padded cache with explicit position ids, so
        a row's numbers do not depend on its neighbours (beyond float rounding). Finished rows are dropped lazily,
        when the cache is rebuilt (new rows join, or half the batch has finished): a drop copies the cache, while a
        finished row costs a decode step little.
        """
        device = next(self.model.parameters()).device
        stop = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
        queue: list = []  # heap of (prompt length, arrival, key, ids): shortest first, then first come
        arrivals = itertools.count()
        for key, ids in prompts:
            heapq.heappush(queue, (len(ids), next(arrivals), key, ids))
        refill = max(1, self.batch_size // 4)
        # Batch rows: [key, generated ids], or None for a finished row still in the cache. Per row: the last
        # sampled token (recorded, to be fed next) and its position; the cache and its attention mask hold
        # everything before it.
        rows: list[list | None] = []
        cache = attention_mask = tokens = positions = None  # -, (B, S), (B,), (B, 1)
        while queue or any(r is not None for r in rows):
            alive = [b for b, r in enumerate(rows) if r is not None]
            refillable = _refillable(cache)
            if queue and (not alive or (self.batch_size - len(alive) >= refill and refillable)):
                new = [heapq.heappop(queue) for _ in range(min(self.batch_size - len(alive), len(queue)))]
                keep = torch.tensor(alive, dtype=torch.long, device=device)
                cache, attention_mask, logits = self._admit([e[3] for e in new], keep, cache, attention_mask)
                new_positions = torch.tensor([[e[0]] for e in new], dtype=torch.long, device=device)  # (B_new, 1)
                new_tokens = self._sample(logits)  # (B_new,)
                tokens = torch.cat([tokens[keep], new_tokens]) if alive else new_tokens
                positions = torch.cat([positions[keep], new_positions]) if alive else new_positions
                first = len(alive)  # only the new rows sampled a token
                rows = [rows[b] for b in alive] + [[e[2], []] for e in new]
            else:
                if 2 * len(alive) <= len(rows):  # half the batch finished: compact
                    keep = torch.tensor(alive, dtype=torch.long, device=device)
                    if refillable:
                        cache, attention_mask, _ = self._admit([], keep, cache, attention_mask)
                    else:
                        cache.batch_select_indices(keep)
                        attention_mask = attention_mask[keep]
                    rows, tokens, positions = [rows[b] for b in alive], tokens[keep], positions[keep]
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
                out = self.model(
                    input_ids=tokens[:, None],
                    attention_mask=attention_mask,
                    position_ids=positions,
                    **cache_kwargs(self.model, cache),
                    use_cache=True,
                )
                tokens = self._sample(out.logits[:, -1, :])  # (B,)
                positions = positions + 1
                first = 0
            finished = torch.isin(tokens, stop).tolist()
            sampled = tokens.tolist()
            for b in range(first, len(rows)):
                row = rows[b]
                if row is None:
                    continue
                if not finished[b]:
                    row[1].append(sampled[b])
                    if len(row[1]) < self.max_new_tokens:
                        continue
                rows[b] = None
                follow = on_done(row[0], row[1], finished[b])
                if follow is not None:
                    heapq.heappush(queue, (len(follow), next(arrivals), row[0], follow))

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B,) token ids: argmax, or a sample at ``temperature`` (no top-k / top-p)."""
        logits = logits.float()
        if self.temperature > 0:
            return torch.multinomial(torch.softmax(logits / self.temperature, dim=-1), 1).squeeze(1)
        return logits.argmax(dim=-1)

    def _admit(self, new: list[list[int]], keep: torch.Tensor, cache, attention_mask):
        """Build the batch's cache: rows ``keep`` of the current one first (moved into a fresh cache,
        right-aligned), then the prompts ``new`` (token ids, ascending length), prefilled.

        Returns:
            ``(cache, attention_mask, logits)``: the new cache, its (B', W) attention mask, and the new rows' last
            prompt position logits, (B_new, V) (``None`` without new rows).
        """
        model = self.model
        device = next(model.parameters()).device
        n_live = len(keep)
        width = max([len(p) for p in new] + ([attention_mask.shape[1]] if n_live else []))
        batch = n_live + len(new)
        big = preallocated_cache(model.config, width + self.max_new_tokens)
        mask = torch.zeros((batch, width), dtype=torch.long, device=device)  # (B', W)
        for j, p in enumerate(new):
            mask[n_live + j, width - len(p) :] = 1
        if not _refillable(big):  # e.g. sliding-window layers: one left-padded prefill, no refills (n_live == 0)
            input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long, device=device)  # (B', W)
            for j, p in enumerate(new):
                input_ids[j, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            self.counts["prefill_tokens"] += input_ids.numel()
            return big, mask, self._prefill(input_ids, mask, big)
        if n_live:
            live = torch.arange(n_live, device=device)
            for big_layer, layer in zip(big.layers, cache.layers):
                big_layer.write_rows(live, batch, width, layer.keys[keep], layer.values[keep])  # (n_live, H, S, hd)
            mask[:n_live, width - attention_mask.shape[1] :] = attention_mask[keep]
        logits = self._prefill_groups(new, n_live, batch, width, big) if new else None
        return big, mask, logits

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        """One prefill forward of left-padded prompts (B, W) into ``cache``: the last position's logits, (B, V)."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),  # left padding: real tokens from position 0
            **cache_kwargs(self.model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _prefill_groups(self, new: list[list[int]], offset: int, batch: int, width: int, big) -> torch.Tensor:
        """Prefill the prompts ``new`` (token ids, ascending length) in groups of similar length and write them into ``big`` at
        rows ``offset...``, right-aligned to ``width``; their last position's logits, (B_new, V).

        A group is padded only to its own longest prompt (at most ``PREFILL_SLACK`` padded tokens per real one):
        prefill is compute-bound, so the padding a left-padded batch of mixed lengths carries is time lost.
        """
        model = self.model
        device = next(model.parameters()).device
        groups, current = [], []
        for j, p in enumerate(new):  # ascending length: a group's padded size is rows x its last prompt's length
            grown = current + [j]
            if current and len(grown) * len(p) > PREFILL_SLACK * sum(len(new[k]) for k in grown):
                groups.append(current)
                grown = [j]
            current = grown
        groups.append(current)
        logits = None
        t0 = time.perf_counter()
        for group in groups:
            w = max(len(new[j]) for j in group)
            self.counts["prefill_tokens"] += w * len(group)
            input_ids = torch.full((len(group), w), self.pad_id, dtype=torch.long)  # (g, w)
            mask = torch.zeros((len(group), w), dtype=torch.long)  # (g, w)
            for k, j in enumerate(group):
                p = new[j]
                input_ids[k, w - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[k, w - len(p) :] = 1
            input_ids, mask = input_ids.to(device), mask.to(device)
            small = new_cache(model.config)
            last = self._prefill(input_ids, mask, small)  # (g, V)
            rows = torch.tensor([offset + j for j in group], dtype=torch.long, device=device)
            for big_layer, layer in zip(big.layers, small.layers):
                big_layer.write_rows(rows, batch, width, layer.keys, layer.values)  # (g, H_kv, w, hd)
            if logits is None:
                logits = last.new_empty(len(new), last.shape[-1])  # (B_new, V)
            logits[torch.tensor(group, dtype=torch.long, device=device)] = last
        self.counts["prefill_seconds"] += time.perf_counter() - t0
        return logits

    def generate(self, prompts: list[list[dict]]) -> list[tuple[str, bool]]:
        """One assistant reply per chat prefix: ``(text, finished_with_end_of_turn)`` (one batch, in order)."""
        results = []
        for ids, ended in self.generate_ids([self.prompt_ids(p) for p in prompts]):
            results.append((self.tokenizer.decode(ids, skip_special_tokens=True).strip(), ended))
        return results

    # ------------------------------------------------------------------------------------------ conversations

    def regenerate(self, conversations: list[list[dict]], progress=None) -> list[list[dict]]:
        """Regenerate the assistant turns of a pool of conversations.

        Every conversation's first turn is queued; as soon as a reply is done, that conversation's next turn (its
        prompt now holding the reply) joins the queue of the running batch (:meth:`run`), so no turn waits for the
        other conversations' same turn.

        Args:
            conversations: normalised ``[{"role", "content"}]`` lists.
            progress: an optional tqdm bar; its postfix shows new tokens/s.

        Returns:
            The regenerated conversations, in input order: the same user/system turns, assistant turns replaced
            (``{"role": "assistant", "content", "truncated"}``). A conversation stops before a turn whose prompt is
            too long or after an empty reply, and after ``max_turns`` assistant turns (counted in ``self.counts``).
        """
        slots = [[j for j, m in enumerate(c) if m["role"] == "assistant"] for c in conversations]
        if self.max_turns is not None:
            for s in slots:
                if len(s) > self.max_turns:
                    del s[self.max_turns :]
                    self.counts["conversations_cut_at_max_turns"] += 1
        new = [[] for _ in conversations]  # regenerated messages so far
        cursor = [0] * len(conversations)  # next original message index to copy
        turn = [0] * len(conversations)  # next assistant turn to generate

        def next_prompt(i: int) -> list[int] | None:
            if turn[i] >= len(slots[i]):
                return None
            j = slots[i][turn[i]]
            new[i].extend(conversations[i][cursor[i] : j])  # the user/system turns before this assistant turn
            cursor[i] = j + 1
            ids = self.prompt_ids(new[i])
            if len(ids) > self.max_prompt_tokens:
                self.counts["stopped_prompt_too_long"] += 1
                return None
            self.counts["prompt_tokens"] += len(ids)
            return ids

        def done(i: int, tokens: list[int], ended: bool) -> list[int] | None:
            self.counts["turns_generated"] += 1
            self.counts["new_tokens"] += len(tokens) + int(ended)  # the stop token is generated too
            if not ended:
                self.counts["turns_truncated"] += 1
            text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            if not text:
                self.counts["stopped_empty_reply"] += 1
                return None
            new[i].append({"role": "assistant", "content": text, "truncated": not ended})
            turn[i] += 1
            return next_prompt(i)

        first = [(i, ids) for i in range(len(conversations)) if (ids := next_prompt(i)) is not None]
        t0 = time.perf_counter()
        self.run(first, done)
        self.counts["generate_seconds"] += time.perf_counter() - t0
        if progress is not None and self.counts["generate_seconds"] > 0:
            progress.set_postfix(tok_s=f"{self.counts['new_tokens'] / self.counts['generate_seconds']:.0f}")
        # Drop trailing user turns left by a stop: a conversation must end with an assistant turn.
        for msgs in new:
            while msgs and msgs[-1]["role"] != "assistant":
                msgs.pop()
        return new


def to_sharegpt(row_id: str, messages: list[dict]) -> dict:
    """A ShareGPT-layout row: ``{"id", "conversations": [{"from": human|gpt|system, "value"[, "truncated"]}]}``.

    ``"truncated": true`` marks an assistant reply cut at ``max_new_tokens`` (no end-of-turn token generated).
    """
    turns = []
    for m in messages:
        turn = {"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]}
        if m.get("truncated"):
            turn["truncated"] = True
        turns.append(turn)
    return {"id": row_id, "conversations": turns}


def regenerate_file(
    input: str,
    output: str,
    regenerator: Regenerator,
    batch_size: int | None = None,
    limit: int | None = None,
    progress: bool = True,
    pool_size: int | None = None,
) -> dict:
    """Regenerate the chats of ``input`` into ``output`` (JSON Lines, appended; ids already there are skipped).

    Args:
        input: chat file (JSON array or JSON Lines, any layout ``vat prep chat`` reads).
        output: output ``.jsonl``.
        regenerator: a :class:`Regenerator`.
        batch_size: rows per decode batch (default: the regenerator's).
        limit: consider only the first ``limit`` input rows (so a resumed run finishes the same set).
        progress: tqdm bar.
        pool_size: conversations read before generating (the scope of length bucketing and the unit written to
            ``output``; default ``4 x batch_size``).

    Returns:
        Stats, also written to ``OUTPUT.stats.json``.
    """
    if batch_size is not None:
        regenerator.batch_size = batch_size
    pool_size = pool_size or DEFAULT_POOL_BATCHES * regenerator.batch_size
    t0 = time.time()
    require_file(input, "input file")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    done = done_ids(output)
    read = ReadStats()
    counts: Counter = Counter()
    start_counts = Counter(regenerator.counts)
    bar = tqdm(desc="regen", unit=" conv", disable=not progress, total=limit)
    with open(output, "a", encoding="utf-8") as f:
        for pool in _new_conversation_pools(input, read, done, limit, pool_size, counts, bar):
            _regenerate_pool(f, regenerator, pool, counts, bar)
    bar.close()
    counts["read"] += read.malformed_json + read.non_object
    counts["skipped_malformed_json"] += read.malformed_json + read.non_object
    seconds = time.time() - t0
    gen = regenerator.counts - start_counts  # this run only (a Regenerator may be reused)
    stats = _regen_stats(input, output, regenerator, counts, gen, read, pool_size, seconds)
    with open(output + ".stats.json", "w") as fs:
        json.dump(stats, fs, indent=2)
    logger.info(
        "regen: %d conversations, %d new tokens in %.1f s (%.0f new tokens/s)",
        counts["written"],
        stats["new_tokens"],
        seconds,
        stats["new_tokens_per_second"],
    )
    return stats


def _new_conversation_pools(
    input: str, read: ReadStats, done: set[str], limit: int | None, pool_size: int, counts: Counter, bar
) -> Iterator[list[tuple[str, list[dict]]]]:
    """The conversations of ``input``'s first ``limit`` rows still to regenerate, as pools of ``pool_size``
    ``(id, messages)`` (the last pool may be smaller). Rows already in the output (``done``), repeated ids and unusable
    rows are counted in ``counts`` and skipped; ``bar`` advances over the rows already done; the reader fills
    ``read``."""
    pending: list[tuple[str, list[dict]]] = []
    seen_in_run: set[str] = set()
    for index, record in enumerate(iter_records(input, read)):
        if limit is not None and index >= limit:
            break
        counts["read"] += 1
        row_id = str(record.get("id", f"row{index}"))
        if row_id in done:
            counts["already_done"] += 1
            bar.update(1)
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
        if len(pending) >= pool_size:
            yield pending
            pending = []
    if pending:
        yield pending


def _regenerate_pool(f, regenerator: Regenerator, pool: list[tuple[str, list[dict]]], counts: Counter, bar) -> None:
    """Regenerate one pool and append its conversations to ``f`` (one ShareGPT line each, in input order)."""
    convs = regenerator.regenerate([m for _, m in pool], progress=bar)
    for (row_id, _), msgs in zip(pool, convs):
        if any(m["role"] == "assistant" for m in msgs):
            f.write(json.dumps(to_sharegpt(row_id, msgs), ensure_ascii=False) + "\n")
            counts["written"] += 1
        else:
            counts["skipped_nothing_generated"] += 1
    f.flush()
    bar.update(len(pool))


def _regen_stats(
    input: str,
    output: str,
    regenerator: Regenerator,
    counts: Counter,
    gen: Counter,
    read: ReadStats,
    pool_size: int,
    seconds: float,
) -> dict:
    """The stats of :func:`regenerate_file`: row counts, this run's generation counts, settings and throughput."""
    new_tokens = int(gen.get("new_tokens", 0))
    return {
        "input": input,
        "output": output,
        **{k: counts[k] for k in ("read", "written", "already_done")},
        "skipped": {k.removeprefix("skipped_"): v for k, v in sorted(counts.items()) if k.startswith("skipped_") and v},
        "generation": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in sorted(gen.items())},
        "truncated_tail": read.truncated_tail,
        "max_new_tokens": regenerator.max_new_tokens,
        "max_prompt_tokens": regenerator.max_prompt_tokens,
        "max_turns": regenerator.max_turns,
        "batch_size": regenerator.batch_size,
        "pool_size": pool_size,
        "temperature": regenerator.temperature,
        "seconds": round(seconds, 2),
        "new_tokens": new_tokens,
        "new_tokens_per_second": round(new_tokens / seconds, 1) if seconds > 0 else 0.0,
        "conversations_per_second": round(counts["written"] / seconds, 3) if seconds > 0 else 0.0,
    }


@contextlib.contextmanager
def cpu_threads(num_threads: int | None):
    """Run with ``num_threads`` torch intra-op threads (``None``: unchanged), restored afterwards.

    A small target decodes fastest single-threaded on CPU: its ops are too small to split, and on a machine shared
    with other jobs two OpenMP threads per process made regeneration 6.4x slower (measured, 2 cores, load ~4).
    """
    before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_generator_model(path: str):
    """The target and its tokenizer for generation (bf16 on GPU, fp32 on CPU)."""
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

    model, tokenizer = load_generator_model(resolve_target_path(args.target))
    regen = Regenerator(
        model,
        tokenizer,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        max_prompt_tokens=args.max_prompt_tokens,
        max_turns=args.max_turns,
        batch_size=args.batch_size,
    )
    threads = args.threads or (1 if next(model.parameters()).device.type == "cpu" else None)
    with cpu_threads(threads):
        stats = regenerate_file(args.input, args.output, regen, limit=args.limit, pool_size=args.pool_size)
    skipped = ", ".join(f"{k}={v}" for k, v in stats["skipped"].items()) or "none"
    gen = stats["generation"]
    print(
        f"read {stats['read']}, written {stats['written']}, already done {stats['already_done']}, skipped: {skipped}; "
        f"{gen.get('turns_generated', 0)} turns ({gen.get('turns_truncated', 0)} truncated), "
        f"{stats['new_tokens']} new tokens in {stats['seconds']} s "
        f"({stats['new_tokens_per_second']:.0f} tok/s, {stats['conversations_per_second']:.2f} conv/s) -> {args.output}"
    )
    return 0
