"""Training-free n-gram drafting ("prompt lookup decoding"; vLLM's ``ngram`` speculator).

Each round, the last n tokens of the sequence (prompt + committed output, the newest token included) are looked up
in the sequence itself, for n = ``n_max`` down to ``n_min``; at the first n with an earlier occurrence, the tokens
that followed one earlier occurrence are proposed, up to K of them (fewer when that occurrence ends near the end of
the sequence). No occurrence for any n = no drafts: the round is a plain one-token verification.

Which occurrence is the ``rule``:

* ``vllm`` (the default): the *earliest* occurrence, exactly as vLLM's ``NgramProposer``
  (``vllm/v1/spec_decode/ngram_proposer.py``, ``_find_longest_matched_ngram_and_propose_tokens``: a KMP scan of the
  reversed sequence that keeps the longest match, capped at ``prompt_lookup_max``, at its latest reversed position)
  and Saxena's original prompt lookup decoding. An occurrence may overlap the suffix itself (a periodic tail), and the
  proposal is ``min(K, tokens after the occurrence)`` long.
* ``recent``: the *most recent* occurrence, which stays on the local context (the latest use of a name, the current
  loop) at the price of one period per proposal inside short loops.

The proposal is a deterministic function of the context, i.e. a point mass q(d) = 1 at each drafted token, so the
chain acceptance rules of :mod:`vat.eval.sampling` apply unchanged: greedy stays lossless, and at T > 0 the rejection
rule min(1, p(d) / q(d)) becomes "accept with probability p(d)", the residual norm(max(p - q, 0)) becomes p with d
removed, renormalised (:func:`point_mass_q`).

Defaults ``n_max = 3``, ``n_min = 1`` are those of the original prompt lookup decoding (Saxena, 2023; also
``transformers``' ``prompt_lookup_num_tokens`` tries n = max..1). vLLM's defaults (``prompt_lookup_min`` =
``prompt_lookup_max`` = 5, marked "arbitrarily chosen" in its source) are ``NgramSpec(n_max=5, n_min=5)``; a
benchmark's free baseline is the best of a small grid (:mod:`vat.eval.free_drafts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from vat.errors import VatError

DEFAULT_N_MAX = 3
DEFAULT_N_MIN = 1
RULES = ("vllm", "recent")  # which earlier occurrence of the matched suffix is copied: the earliest, the latest


@dataclass(frozen=True)
class NgramSpec:
    """Settings of the n-gram draft (what :class:`vat.eval.engine.SpeculativeEngine` takes as its drafter).

    Attributes:
        n_max: longest suffix matched (vLLM's ``prompt_lookup_max``).
        n_min: shortest suffix matched (vLLM's ``prompt_lookup_min``).
        rule: ``vllm`` (copy after the earliest occurrence) or ``recent`` (after the latest).
    """

    n_max: int = DEFAULT_N_MAX
    n_min: int = DEFAULT_N_MIN
    rule: str = "vllm"

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max:
            raise VatError(f"n-gram draft needs 1 <= --ngram-min <= --ngram-n, got min {self.n_min}, max {self.n_max}")
        if self.rule not in RULES:
            raise VatError(f"unknown n-gram rule `{self.rule}`; expected one of {', '.join(RULES)}")

    @property
    def label(self) -> str:
        """The draft's name in tables: ``ngram`` + rule and the (min, max) n, e.g. ``ngram-vllm-1-3``."""
        return f"ngram-{self.rule}-{self.n_min}-{self.n_max}"

    def session(self) -> NgramSpec:
        """The state shared by the decodes of one benchmark pass: none (each lookup reads only its own sequence)."""
        return self

    def start(self, prompt_ids: Sequence[int]) -> PromptLookup:
        """The lookup of one decode, over its prompt (committed tokens are added with ``extend``)."""
        return PromptLookup(self, prompt_ids)


class PromptLookup:
    """The n-gram index of one sequence, extended as tokens are committed; proposes drafts in O(n_max) per round.

    ``_where`` maps every n-gram (a tuple, n_min <= n <= n_max) that has at least one token after it to the start of
    its earliest (rule ``vllm``) or most recent (rule ``recent``) such occurrence. An n-gram is entered when the token
    after it is appended, so the sequence's own suffix is never its own match and a hit always has a continuation.

    Args:
        spec: n_max / n_min.
        tokens: the initial sequence (the prompt, plus the first generated token).
    """

    def __init__(self, spec: NgramSpec, tokens: Iterable[int] = ()):
        self.spec = spec
        self.tokens: list[int] = []
        self._where: dict[tuple[int, ...], int] = {}
        self._earliest = spec.rule == "vllm"
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens and index the n-grams they complete as continuations."""
        seq = self.tokens
        for token in tokens:
            j = len(seq)  # the new token's position: every n-gram ending at j - 1 now has a continuation
            for n in range(self.spec.n_min, min(self.spec.n_max, j) + 1):
                if self._earliest:
                    self._where.setdefault(tuple(seq[j - n : j]), j - n)
                else:
                    self._where[tuple(seq[j - n : j])] = j - n
            seq.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the rule's earlier occurrence of the longest matching suffix."""
        seq = self.tokens
        if k <= 0:
            return []
        for n in range(min(self.spec.n_max, len(seq)), self.spec.n_min - 1, -1):
            start = self._where.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start + n : start + n + k]
        return []


def propose_reference(tokens: Sequence[int], k: int, n_max: int, n_min: int, rule: str = "vllm") -> list[int]:
    """The obvious O(length) scan :class:`PromptLookup` must equal (kept for the parity test).

    Args:
        tokens: the sequence (prompt + committed output).
        k: most tokens proposed.
        n_max, n_min: suffix lengths tried, longest first.
        rule: ``vllm`` (earliest occurrence) or ``recent`` (latest).

    Returns:
        The tokens after the rule's earlier occurrence of the longest matching suffix (``[]`` when none).
    """
    seq = list(tokens)
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if len(seq) < n + 1:
            continue
        suffix = seq[-n:]
        starts = range(len(seq) - n)  # starts whose n-gram is followed by at least one token
        for start in (starts if rule == "vllm" else reversed(starts)):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


def point_mass_q(tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(K',) deterministic drafts -> (K', V) one-hot proposal distributions for chain rejection sampling.

    With q(d) = 1 the chain rule accepts d with probability min(1, p(d)) = p(d) and, on rejection, draws from
    norm(max(p - q, 0)) = p without d, renormalised: every committed token is still distributed exactly as p.
    """
    q = torch.zeros(tokens.shape[0], vocab_size, dtype=dtype, device=tokens.device)  # (K', V)
    return q.scatter_(1, tokens.view(-1, 1), 1.0)
