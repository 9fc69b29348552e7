"""Training-free n-gram drafting ("prompt lookup decoding"; vLLM's ``ngram`` speculator).

Each round, the last n tokens of the sequence (prompt + committed output, the newest token included) are looked up
in the sequence itself, for n = ``n_max`` down to ``n_min``; at the first n with an earlier occurrence, the tokens
that followed the *most recent* earlier occurrence are proposed, up to K of them (fewer when that occurrence ends
near the end of the sequence). No occurrence for any n = no drafts: the round is a plain one-token verification.

The proposal is a deterministic function of the context, i.e. a point mass q(d) = 1 at each drafted token, so the
chain acceptance rules of :mod:`vat.eval.sampling` apply unchanged: greedy stays lossless, and at T > 0 the rejection
rule min(1, p(d) / q(d)) becomes "accept with probability p(d)", the residual norm(max(p - q, 0)) becomes p with d
removed, renormalised (:func:`point_mass_q`).

Defaults ``n_max = 3``, ``n_min = 1`` are those of the original prompt lookup decoding (Saxena, 2023; also
``transformers``' ``prompt_lookup_num_tokens`` tries n = max..1). vLLM's defaults (``prompt_lookup_min`` =
``prompt_lookup_max`` = 5, marked "arbitrarily chosen" in its source) are ``NgramSpec(n_max=5, n_min=5)``. vLLM and
Saxena's code take the *earliest* occurrence of the matched n-gram; this module takes the most recent one, which
stays on the local context (the latest use of a name, the current loop) at the price of shorter proposals inside
short periodic loops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from vat.errors import VatError

DEFAULT_N_MAX = 3
DEFAULT_N_MIN = 1


@dataclass(frozen=True)
class NgramSpec:
    """Settings of the n-gram draft (what :class:`vat.eval.engine.SpeculativeEngine` takes as its drafter).

    Attributes:
        n_max: longest suffix matched (vLLM's ``prompt_lookup_max``).
        n_min: shortest suffix matched (vLLM's ``prompt_lookup_min``).
    """

    n_max: int = DEFAULT_N_MAX
    n_min: int = DEFAULT_N_MIN

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max:
            raise VatError(f"n-gram draft needs 1 <= --ngram-min <= --ngram-n, got min {self.n_min}, max {self.n_max}")


class PromptLookup:
    """The n-gram index of one sequence, extended as tokens are committed; proposes drafts in O(n_max) per round.

    ``_last`` maps every n-gram (a tuple, n_min <= n <= n_max) that has at least one token after it to the start of
    its most recent such occurrence. An n-gram is entered when the token after it is appended, so the sequence's own
    suffix is never its own match and a hit always has a continuation.

    Args:
        spec: n_max / n_min.
        tokens: the initial sequence (the prompt, plus the first generated token).
    """

    def __init__(self, spec: NgramSpec, tokens: Iterable[int] = ()):
        self.spec = spec
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens and index the n-grams they complete as continuations."""
        seq = self.tokens
        for token in tokens:
            j = len(seq)  # the new token's position: every n-gram ending at j - 1 now has a continuation
            for n in range(self.spec.n_min, min(self.spec.n_max, j) + 1):
                self._last[tuple(seq[j - n : j])] = j - n
            seq.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        seq = self.tokens
        if k <= 0:
            return []
        for n in range(min(self.spec.n_max, len(seq)), self.spec.n_min - 1, -1):
            start = self._last.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start + n : start + n + k]
        return []


def propose_reference(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The obvious O(length) scan :class:`PromptLookup` must equal (kept for the parity test).

    Args:
        tokens: the sequence (prompt + committed output).
        k: most tokens proposed.
        n_max, n_min: suffix lengths tried, longest first.

    Returns:
        The tokens after the most recent earlier occurrence of the longest matching suffix (``[]`` when none).
    """
    seq = list(tokens)
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if len(seq) < n + 1:
            continue
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # starts whose n-gram is followed by at least one token
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
