"""Training-free suffix decoding (Oliaro et al., 2024; vLLM's ``method: suffix``, Arctic Inference's cache).

Two count tries over token sequences, each node counting how many suffixes (start positions) pass through it, cut at
``max_depth`` tokens:

* the *local* trie of one request: its prompt and its response so far;
* the *global* trie of one benchmark pass: the responses of every request decoded so far in the pass, the current one
  included, as a server's cache of earlier outputs (vLLM's ``suffix_decoding_max_cached_requests`` is 10,000: no
  eviction at benchmark scale).

Each round, with context = the last ``max_depth`` tokens of prompt + output, for every match length m = 1 .. len - 1
(stopping at the first m whose suffix of the context is absent), the path of most frequent continuations is followed
from the node of the context's last m tokens: token i gets probability p_i = Π count(child) / count(parent) along the
path, and the path stops at ``min(K, floor(max_spec_factor x m + max_spec_offset))`` tokens, at a node without
children, or before a token with p_i < ``min_token_prob``. A path's score is Σ p_i; the best score over m wins (a
longer match on a tie), and the local trie's draft wins a tie with the global one. This is Arctic Inference's
``SuffixTree::speculate`` without tree speculation (vLLM verifies one path), with vLLM's defaults: depth 24, factor
1.0, offset 0, min probability 0.1. Two details of that implementation are not reproduced: ties between equally
frequent children go to the child seen first here (its order there depends on its count-group bookkeeping), and
counts are exact per token where its compressed edges may share one count.

Drafts are a deterministic function of the context (point-mass proposals), verified like n-gram drafts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vat.errors import VatError

DEFAULT_MAX_DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth
DEFAULT_MAX_SPEC_FACTOR = 1.0  # vLLM's suffix_decoding_max_spec_factor
DEFAULT_MIN_TOKEN_PROB = 0.1  # vLLM's suffix_decoding_min_token_prob


@dataclass(frozen=True)
class SuffixSpec:
    """Settings of the suffix-decoding draft (a drafter :class:`vat.eval.engine.SpeculativeEngine` takes).

    Attributes:
        max_depth: the tries' depth and the longest context matched.
        max_spec_factor: at most ``max_spec_factor x match length + max_spec_offset`` tokens per round.
        max_spec_offset: see ``max_spec_factor``.
        min_token_prob: a path stops before a token whose estimated probability is below this.
        use_global: also match the pass's earlier responses (False = the request's own prompt and output only).
    """

    max_depth: int = DEFAULT_MAX_DEPTH
    max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    max_spec_offset: float = 0.0
    min_token_prob: float = DEFAULT_MIN_TOKEN_PROB
    use_global: bool = True

    def __post_init__(self):
        if self.max_depth < 2:
            raise VatError(f"suffix decoding needs a depth of at least 2, got {self.max_depth}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise VatError(f"suffix decoding's min token probability must lie in [0, 1], got {self.min_token_prob}")

    @property
    def label(self) -> str:
        """The draft's name in tables (``suffix``, with non-default settings appended)."""
        parts = ["suffix"]
        if self.max_depth != DEFAULT_MAX_DEPTH:
            parts.append(f"d{self.max_depth}")
        if not self.use_global:
            parts.append("local")
        return "-".join(parts)

    def session(self) -> SuffixSession:
        """A fresh cache for one benchmark pass (the global trie starts empty)."""
        return SuffixSession(self)


@dataclass
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class CountTrie:
    """Every suffix of the sequences added, cut at ``max_depth`` tokens, as a trie whose nodes count the suffixes
    through them: ``count(s)`` = occurrences of the token string ``s`` (|s| <= max_depth) over all sequences."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()
        self._open: dict[int, list[tuple[_Node, int]]] = {}  # sequence -> (node, depth) of suffixes still growing

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id``: every suffix ending at them gains a node count. O(depth)/token."""
        growing = self._open.setdefault(seq_id, [])
        for token in tokens:
            token = int(token)
            self.root.count += 1
            nxt = []
            for node, depth in [*growing, (self.root, 0)]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                if depth + 1 < self.max_depth:
                    nxt.append((child, depth + 1))
            growing[:] = nxt

    def find(self, tokens: Sequence[int]) -> _Node | None:
        """The node of the string ``tokens`` (None when it never occurred)."""
        node = self.root
        for token in tokens:
            node = node.children.get(int(token))
            if node is None:
                return None
        return node


@dataclass
class SuffixDraft:
    """One speculation: tokens, their estimated probabilities, score Σ p and the context match length."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


def follow_path(node: _Node, max_tokens: int, min_prob: float) -> SuffixDraft:
    """The path of most frequent continuations below ``node`` (ties: the child seen first)."""
    draft = SuffixDraft()
    prob = 1.0
    while len(draft.tokens) < max_tokens and node.children:
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)  # first of equal counts
        prob *= child.count / node.count
        if prob < min_prob:
            break
        draft.tokens.append(token)
        draft.probs.append(prob)
        draft.score += prob
        node = child
    return draft


def speculate(trie: CountTrie, context: Sequence[int], max_tokens: int, spec: SuffixSpec) -> SuffixDraft:
    """The best-scoring path over match lengths 1 .. len(context) - 1 (a longer match wins a tie)."""
    context = list(context)[-spec.max_depth :]
    best = SuffixDraft()
    for match_len in range(1, len(context)):
        node = trie.find(context[-match_len:])
        if node is None:
            break
        cap = max(0, min(max_tokens, int(match_len * spec.max_spec_factor + spec.max_spec_offset + 1e-6)))
        draft = follow_path(node, cap, spec.min_token_prob)
        if draft.score >= best.score:
            draft.match_len = match_len
            best = draft
    return best


class SuffixSession:
    """The cache of one benchmark pass: the global trie of responses, and the requests decoded in it."""

    def __init__(self, spec: SuffixSpec):
        self.spec = spec
        self.global_trie = CountTrie(spec.max_depth)
        self._requests = 0

    def start(self, prompt_ids: Sequence[int]) -> SuffixRequest:
        """A new request over ``prompt_ids``; its response joins the global trie as it is committed."""
        self._requests += 1
        return SuffixRequest(self, self._requests, prompt_ids)


class SuffixRequest:
    """One decode's suffix-decoding state (the interface of :class:`vat.eval.ngram.PromptLookup`)."""

    def __init__(self, session: SuffixSession, seq_id: int, prompt_ids: Sequence[int]):
        self.session = session
        self.seq_id = seq_id
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.local = CountTrie(session.spec.max_depth)
        self.local.extend(0, self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed output tokens to the request's trie and to the pass's global trie."""
        tokens = [int(t) for t in tokens]
        self.tokens.extend(tokens)
        self.local.extend(0, tokens)
        self.session.global_trie.extend(self.seq_id, tokens)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` drafted tokens: the better of the local and the global trie's speculation."""
        spec = self.session.spec
        if k <= 0:
            return []
        best = speculate(self.local, self.tokens, k, spec)
        if spec.use_global:
            other = speculate(self.session.global_trie, self.tokens, k, spec)
            if other.score > best.score:
                best = other
        return best.tokens


def count_reference(sequences: Sequence[Sequence[int]], string: Sequence[int]) -> int:
    """Occurrences of ``string`` in ``sequences`` by a plain scan (the trie's counts must equal this)."""
    n = len(string)
    return sum(list(seq[i : i + n]) == list(string) for seq in sequences for i in range(len(seq) - n + 1))


def speculate_reference(sequences: Sequence[Sequence[int]], context: Sequence[int], max_tokens: int,
                        spec: SuffixSpec) -> list[int]:
    """Suffix decoding's path computed from plain occurrence counts over ``sequences`` (no trie): the slow
    obvious version :func:`speculate` must equal, for the parity test."""
    context = list(context)[-spec.max_depth :]
    best_tokens, best_score = [], 0.0
    for match_len in range(1, len(context)):
        string = context[-match_len:]
        if count_reference(sequences, string) == 0:
            break
        cap = max(0, min(max_tokens, int(match_len * spec.max_spec_factor + spec.max_spec_offset + 1e-6)))
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < cap and len(string) < spec.max_depth:
            parent = count_reference(sequences, string)
            vocab = sorted({t for seq in sequences for t in seq})
            counts = {t: count_reference(sequences, [*string, t]) for t in vocab}
            counts = {t: c for t, c in counts.items() if c > 0}
            if not counts:
                break
            top = max(counts.values())
            # the child seen first among the most frequent: the earliest occurrence in the order sequences were added
            first = min((i, t) for t in counts if counts[t] == top
                        for i in [_first_occurrence(sequences, [*string, t])])[1]
            prob *= top / parent
            if prob < spec.min_token_prob:
                break
            tokens.append(first)
            score += prob
            string = [*string, first]
        if score >= best_score:
            best_tokens, best_score = tokens, score
    return best_tokens


def _first_occurrence(sequences: Sequence[Sequence[int]], string: Sequence[int]) -> tuple[int, int]:
    """(sequence, end position) of the first occurrence of ``string`` in trie insertion order: sequence by sequence
    (requests are decoded one after another), token by token within one."""
    n = len(string)
    hits = [(s, i + n - 1) for s, seq in enumerate(sequences) for i in range(len(seq) - n + 1)
            if list(seq[i : i + n]) == list(string)]
    return min(hits)
