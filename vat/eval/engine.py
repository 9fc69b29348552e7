"""The speculative-decoding loop on the HF target: prefill, then rounds of draft -> verify -> accept.

One :class:`SpeculativeEngine` decodes one sequence at a time (batch size 1) in one of five modes:

* ``ar``: no draft; each round is one target forward of the newest token (the autoregressive baseline);
* ``chain``: EAGLE-3 top-1 chain of K drafts per round (:mod:`vat.eval.chain`);
* ``ngram``: a chain of up to K training-free drafts per round, from prompt lookup (:mod:`vat.eval.ngram`) or suffix
  decoding (:mod:`vat.eval.suffix`), verified by the same chain round as EAGLE-3 (same block layout, budget, union
  and acceptance rules; zero drafts = a one-token round). Suffix decoding's cache of earlier responses lives as long
  as the engine (one benchmark pass), as a server's would; :meth:`SpeculativeEngine.start_pass` empties it.
* ``tree``: EAGLE dynamic tree per round (:mod:`vat.eval.tree`);
* ``block``: a DFlash block of ``block_size - 1`` drafts per round (:mod:`vat.eval.block`), verified by the chain
  round (same layout, budget, union and acceptance rules).

State between rounds: the target's ``DynamicCache`` holds every committed token except the newest (the *root*, fed
first in the next verification block); the draft's cache holds one entry per committed position
(:mod:`vat.eval.draft_state`, or the DFlash context of :mod:`vat.eval.block`), extended with the target's aux
features of the accepted positions. The prefill is
unbudgeted; each verification forward gets ``BudgetSpec(B, policy)`` with ``window=None``: the block is the window.
The routing each verification forward executes is captured and reduced to the union of experts per MoE layer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from vat.config import DEFAULT_BUDGET_POLICY
from vat.drafters.dflash import DFlashDrafter
from vat.drafters.eagle3 import Eagle3Drafter
from vat.errors import VatError
from vat.eval.block import BlockState, draft_block
from vat.eval.chain import ChainDraft, draft_chain, judge_chain
from vat.eval.draft_state import DraftHead, DraftState
from vat.eval.free_drafts import is_free_draft
from vat.eval.ngram import NgramSpec, PromptLookup, point_mass_q
from vat.eval.policies import RoundPolicy
from vat.eval.sampling import choose_token
from vat.eval.suffix import SuffixRequest, SuffixSpec
from vat.eval.tree import TreeSpec, build_tree, judge_tree
from vat.target import BudgetSpec, FrozenTarget, window_union
from vat.target.cache import (
    cache_length,
    crop_cache,
    new_cache,
    select_cache_positions,
    sliding_window_limit,
    tree_attention_mask,
)


@dataclass
class RoundStats:
    """What one verification round did.

    Attributes:
        drafted: drafted tokens in the verification block (block length - 1; 0 for AR).
        depth: draft positions offered (chain: drafted; tree: its deepest level).
        accepted: drafts accepted (a).
        reached: draft positions reached by the left-to-right check (chain: min(a + 1, drafted)).
        committed: tokens committed this round and kept (a + 1, fewer when EOS / max-new-tokens cut the round).
        union: experts executed per MoE layer in the verification forward (sentinel slots excluded), length L'.
        drafted_depth: depth the draft ran to (a tree's levels drafted, whatever its selection kept; a chain's length
            before a policy (EVICT) cut it; -1 = ``depth``); the cost model prices the draft forwards that really ran.
        expert_sets: with ``record_experts``: the experts the verification forward executed, per MoE layer (sorted
            ids, sentinel slots excluded; ``len(expert_sets[l]) == union[l]``); None otherwise.
        input_experts: with ``record_experts``: (a + 1, L', k) executed ids at the block positions whose tokens were
            committed as inputs (the root, then the accepted drafts; tree: the accepted path), i.e. what an
            autoregressive step of each of those tokens executes; the sentinel ``num_experts`` marks a dropped slot.
    """

    drafted: int
    depth: int
    accepted: int
    reached: int
    committed: int = 0
    union: list[int] = field(default_factory=list)
    drafted_depth: int = -1
    expert_sets: list[list[int]] | None = None
    input_experts: torch.Tensor | None = None


@dataclass
class Generation:
    """One decoded sequence.

    Attributes:
        token_ids: generated tokens (EOS included when it ended the sequence).
        rounds: one :class:`RoundStats` per verification (or AR) forward.
        target_forwards: prefill + verification forwards.
        seconds: wall-clock seconds of the whole decode (prefill, drafting, verification).
        prompt_tokens: prompt length.
    """

    token_ids: list[int]
    rounds: list[RoundStats]
    target_forwards: int
    seconds: float
    prompt_tokens: int


@dataclass
class _Outcome:
    stats: RoundStats
    tokens: list[int]  # committed tokens, newest last
    aux: torch.Tensor | None  # (1, a + 1, 3*H_t) aux states of the accepted block entries


class SpeculativeEngine:
    """Speculative (or plain autoregressive) decoding of one sequence at a time on a :class:`FrozenTarget`.

    Args:
        target: the target; its ``aux_layer_ids`` must be the draft's.
        drafter: an EAGLE-3 draft with its embedding attached, a DFlash draft with the target's embedding and LM head
            attached (block drafting), an :class:`NgramSpec` (prompt lookup) or :class:`SuffixSpec` (suffix decoding)
            for a training-free draft, or None for the autoregressive baseline.
        steps: chain length K (EAGLE-3 chain or n-gram drafts per round; a DFlash block drafts its block_size - 1).
        tree: a :class:`TreeSpec` for dynamic-tree drafting with an EAGLE-3 draft (None = chain).
        temperature: 0 = greedy (lossless), > 0 = rejection sampling at this temperature.
        budget: expert budget B of the verification forwards (int, per-layer list or mapping; None = natural).
        policy: ``substitute`` or ``truncate``.
        vh_threshold: stop drafting where the verification head's acceptance probability falls below this (a DFlash
            block is truncated before that slot).
        draft_confidence: an EAGLE-3 chain stops after a drafted token the draft gave less than this probability
            (the token is verified; transformers' ``assistant_confidence_threshold``). None = draft all K.
        policies: the round hooks of this pass (:class:`vat.eval.policies.RoundPolicy`, applied in order): cut each
            drafted chain, DFlash block or tree before verification (EVICT: :class:`vat.eval.evict.Evict`; n-gram
            chains are never cut), choose the tree's nodes (EcoSpec: :class:`vat.eval.ecospec.EcoSpec`; at most one
            selector), adjust the verification budget (AcceptMoE's commitment weighting under policy ``acceptmoe``:
            :class:`vat.eval.policies.acceptmoe.AcceptMoEBudget`). Empty = verify everything drafted.
        max_new_tokens: generated tokens per sequence (the prefill's token included).
        eos_token_ids: tokens that end a sequence.
        record_experts: keep each round's executed expert ids (``RoundStats.expert_sets`` / ``input_experts``), the
            trace the offload model (:mod:`vat.eval.offload`) replays.
    """

    def __init__(
        self,
        target: FrozenTarget,
        drafter: Eagle3Drafter | DFlashDrafter | NgramSpec | SuffixSpec | None = None,
        *,
        steps: int = 7,
        tree: TreeSpec | None = None,
        temperature: float = 0.0,
        budget=None,
        policy: str = DEFAULT_BUDGET_POLICY,
        vh_threshold: float | None = None,
        draft_confidence: float | None = None,
        policies: Sequence[RoundPolicy] = (),
        max_new_tokens: int = 256,
        eos_token_ids: Iterable[int] = (),
        record_experts: bool = False,
    ):
        if is_free_draft(drafter) and tree is not None:
            raise VatError("n-gram and suffix drafts are chains of --steps tokens: drop --tree for them")
        if isinstance(drafter, DFlashDrafter) and tree is not None:
            raise VatError("a DFlash draft drafts one block per round: drop --tree for it")
        if draft_confidence is not None and (tree is not None or not isinstance(drafter, Eagle3Drafter)):
            raise VatError("--draft-confidence stops an EAGLE-3 chain: a tree, a DFlash block, a free draft or AR "
                           "has no chain to stop")
        self.target = target
        self.drafter = drafter
        self.steps = steps
        self.tree = tree
        self.temperature = float(temperature)
        self.policies = list(policies)
        self.budget = self._budget_spec(budget, policy)
        self.vh_threshold = vh_threshold
        self.draft_confidence = draft_confidence
        self.max_new_tokens = max_new_tokens
        self.eos = {int(t) for t in eos_token_ids}
        self.record_experts = record_experts
        self._window = sliding_window_limit(target.config) if tree is not None else None
        self._lookups = drafter.session() if is_free_draft(drafter) else None

    def _budget_spec(self, budget, policy: str) -> BudgetSpec | None:
        """The verification forwards' budget, as the policies adjust it (None = natural routing)."""
        if budget is None:
            return None
        spec = BudgetSpec(B=budget, policy=policy)
        for p in self.policies:
            spec = p.budget_spec(spec)
        return spec

    def start_pass(self) -> None:
        """Forget what the warm-up did: a free draft's session (suffix decoding's cache of earlier responses) and the
        round policies' pass state (AcceptMoE's live expert cache)."""
        if self._lookups is not None:
            self._lookups = self.drafter.session()
        for p in self.policies:
            p.start_pass()

    @property
    def mode(self) -> str:
        """``ar``, ``chain``, ``ngram``, ``tree`` or ``block``."""
        if self.drafter is None:
            return "ar"
        if is_free_draft(self.drafter):
            return "ngram"
        if isinstance(self.drafter, DFlashDrafter):
            return "block"
        return "tree" if self.tree is not None else "chain"

    # ---- the loop ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], generator: torch.Generator | None = None) -> Generation:
        """Decode one sequence.

        Args:
            prompt_ids: the rendered prompt's token ids (non-empty).
            generator: randomness for T > 0 (on the target's device).

        Returns:
            A :class:`Generation`.
        """
        device = self.target.device
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # (1, n)
        start = time.perf_counter()
        cache = new_cache()
        eagle = self.mode in ("chain", "tree")
        features = eagle or self.mode == "block"  # the draft reads the target's features
        out = self.target.forward(prompt, past_key_values=cache, use_cache=True, capture_routing=False,
                                  output_aux=features)
        root = choose_token(out.logits[0, -1], self.temperature, generator)
        tokens = [root]
        state = None
        if eagle:
            state = DraftState(self.drafter, self.temperature)
        elif self.mode == "block":
            state = BlockState(self.drafter, self.temperature)
        # the lookup's context is prompt + output; built here, inside the timed decode, as a server would
        lookup = None
        if self._lookups is not None:
            lookup = self._lookups.start(prompt_ids)
            lookup.extend([root])
        pending = None
        if state is not None:
            nxt = torch.cat([prompt[:, 1:], prompt.new_tensor([[root]])], dim=1)  # (1, n): token after each position
            pending = (out.aux_hidden, nxt)
        rounds: list[RoundStats] = []
        while not self._finished(tokens):
            head = state.extend(*pending) if state is not None else None
            outcome = self._round(cache, state, head, lookup, tokens[-1], generator)
            outcome.stats.committed = self._commit(tokens, outcome.tokens)
            rounds.append(outcome.stats)
            if lookup is not None:
                lookup.extend(outcome.tokens[: outcome.stats.committed])
            if state is not None:
                a = len(outcome.tokens)
                pending = (outcome.aux, torch.tensor([outcome.tokens], device=device).view(1, a))
        seconds = time.perf_counter() - start
        return Generation(
            token_ids=tokens, rounds=rounds, target_forwards=1 + len(rounds), seconds=seconds,
            prompt_tokens=prompt.shape[1],
        )

    def _finished(self, tokens: list[int]) -> bool:
        return len(tokens) >= self.max_new_tokens or tokens[-1] in self.eos

    def _commit(self, tokens: list[int], new: list[int]) -> int:
        """Append ``new`` to ``tokens`` up to EOS / max-new-tokens; return how many were kept."""
        kept = 0
        for t in new:
            if self._finished(tokens):
                break
            tokens.append(t)
            kept += 1
        return kept

    def _round(
        self, cache, state: DraftState | BlockState | None, head: DraftHead | None,
        lookup: PromptLookup | SuffixRequest | None,
        root: int, generator,
    ) -> _Outcome:
        if self.mode == "ar":
            return self._ar_round(cache, root, generator)
        if self.mode == "block":
            draft = draft_block(state, root, vh_threshold=self.vh_threshold, generator=generator)
            return self._cut_chain_round(cache, draft, root, generator)
        if self.mode == "chain":
            draft = draft_chain(state, head, self.steps, vh_threshold=self.vh_threshold,
                                confidence=self.draft_confidence, generator=generator)
            return self._cut_chain_round(cache, draft, root, generator)
        if self.mode == "ngram":
            proposed = lookup.propose(self.steps)
            draft = ChainDraft(tokens=torch.tensor(proposed, dtype=torch.long, device=self.target.device), q=None)
            return self._chain_round(cache, draft, root, generator)
        return self._tree_round(cache, state, head, root, generator)

    # ---- rounds --------------------------------------------------------------------------------------------------

    def _cut_chain_round(self, cache, draft: ChainDraft, root: int, generator) -> _Outcome:
        """A chain (or DFlash block) round, the chain first cut by the policies (EVICT) when there are any."""
        if not self.policies:
            return self._chain_round(cache, draft, root, generator)
        drafted = int(draft.tokens.shape[0])
        for p in self.policies:
            draft = p.cut_chain(draft, cache_length(cache), self.mode)
        outcome = self._chain_round(cache, draft, root, generator)
        outcome.stats.drafted_depth = drafted  # what the draft ran, before the cut
        for p in self.policies:
            p.observe(list(range(outcome.stats.accepted)))
        return outcome

    def _selector(self, root: int):
        """The tree's node selection of this round (None = by log-probability): at most one policy gives one."""
        return self._one_hook("selector", root, "choose the tree's nodes")

    def _expander(self, root: int):
        """Which candidates each draft step of this round's tree expands (None = by log-probability)."""
        return self._one_hook("expander", root, "choose the nodes a draft step expands")

    def _one_hook(self, name: str, root: int, what: str):
        hooks = [h for p in self.policies if (h := getattr(p, name)(root)) is not None]
        if len(hooks) > 1:
            raise VatError(f"{len(hooks)} policies {what}: keep one")
        return hooks[0] if hooks else None

    def _union(self, topk_ids: torch.Tensor) -> list[int]:
        """(L', 1, T, k) executed ids of one verification forward -> experts per layer (the block is one window)."""
        groups = torch.zeros(1, topk_ids.shape[2], dtype=torch.long, device=topk_ids.device)  # (1, T)
        return window_union(topk_ids, groups, 1, self.target.num_experts)[:, 0].tolist()

    def _stats(self, topk_ids: torch.Tensor, path: list[int], **counts) -> RoundStats:
        """A round's :class:`RoundStats` with its union of (L', 1, T, k) executed ids and, with ``record_experts``,
        the ids themselves (``path``: block indices of the committed inputs, root first)."""
        stats = RoundStats(**counts, union=self._union(topk_ids))
        observers = [p for p in self.policies if p.observes_experts]
        if self.record_experts or observers:
            ids = topk_ids[:, 0].cpu()  # (L', T, k)
            E = self.target.num_experts
            expert_sets = [sorted({int(e) for e in layer.flatten().tolist() if e < E}) for layer in ids]
            for p in observers:
                p.executed(expert_sets, ids)
            if self.record_experts:
                stats.expert_sets = expert_sets
                stats.input_experts = ids[:, path].permute(1, 0, 2).contiguous()  # (a + 1, L', k)
        return stats

    def _ar_round(self, cache, root: int, generator) -> _Outcome:
        block = torch.tensor([[root]], device=self.target.device)  # (1, 1)
        out = self.target.forward(block, past_key_values=cache, use_cache=True, budget=self.budget, output_aux=False)
        token = choose_token(out.logits[0, -1], self.temperature, generator)
        stats = self._stats(out.topk_ids, [0], drafted=0, depth=0, accepted=0, reached=0)
        return _Outcome(stats=stats, tokens=[token], aux=None)

    def _chain_round(self, cache, draft: ChainDraft, root: int, generator) -> _Outcome:
        """Verify a chain of drafts (EAGLE-3, DFlash block or n-gram; K' = 0 is a one-token round) and accept a prefix
        of it."""
        n = cache_length(cache)
        eagle = self.mode in ("chain", "block")  # the draft needs the accepted positions' features
        block = torch.cat([draft.tokens.new_tensor([root]), draft.tokens])[None]  # (1, K' + 1)
        out = self.target.forward(block, past_key_values=cache, use_cache=True, budget=self.budget, output_aux=eagle)
        if self.temperature > 0 and draft.q is None:
            # a deterministic proposal is a point mass: the standard rule then accepts d with probability p(d) and
            # resamples from p without d, so the output keeps exactly the target's distribution
            draft = ChainDraft(tokens=draft.tokens, q=point_mass_q(draft.tokens, out.logits.shape[-1]))  # (K', V)
        verdict = judge_chain(out.logits[0], draft, self.temperature, generator)
        a = verdict.accepted
        crop_cache(cache, n + a + 1)
        drafted = int(draft.tokens.shape[0])
        stats = self._stats(out.topk_ids, list(range(a + 1)), drafted=drafted, depth=drafted, accepted=a,
                            reached=min(a + 1, drafted))
        tokens = draft.tokens[:a].tolist() + [verdict.next_token]
        return _Outcome(stats=stats, tokens=tokens, aux=out.aux_hidden[:, : a + 1] if eagle else None)

    def _tree_round(self, cache, state: DraftState, head: DraftHead, root: int, generator) -> _Outcome:
        device = self.target.device
        n = cache_length(cache)
        tree = build_tree(state, head, self.tree, vh_threshold=self.vh_threshold, select=self._selector(root),
                          expand=self._expander(root))
        drafted_depth = tree.drafted_depth  # levels drafted: the selection (and a cut) may keep fewer
        for p in self.policies:
            tree = p.cut_tree(tree, n, self.tree.top_k)
        block = torch.tensor([[root] + tree.tokens], device=device)  # (1, N + 1)
        if self._window is not None and n + block.shape[1] > self._window:
            raise VatError(
                f"tree verification past the target's sliding window ({self._window} positions) would bypass it: "
                "use a chain (drop --tree) or shorter generations"
            )
        positions = (n + tree.block_depths().to(device))[None]  # (1, N + 1)
        mask = tree_attention_mask(tree.ancestors().to(device), n, self.target.dtype)  # (1, 1, N+1, n+N+1)
        out = self.target.forward(
            block, mask, position_ids=positions, past_key_values=cache, use_cache=True, budget=self.budget
        )
        verdict = judge_tree(out.logits[0], tree, self.temperature, generator)
        path = torch.tensor(verdict.path, device=device)  # (a + 1,) block indices, root first
        select_cache_positions(cache, torch.cat([torch.arange(n, device=device), n + path]))
        a = len(verdict.path) - 1
        stats = self._stats(out.topk_ids, list(verdict.path), drafted=len(tree), depth=max(tree.depths, default=0),
                            accepted=a, reached=verdict.reached, drafted_depth=drafted_depth)
        for p in self.policies:
            p.observe([b - 1 for b in verdict.path[1:]])
        tokens = [tree.tokens[b - 1] for b in verdict.path[1:]] + [verdict.next_token]
        return _Outcome(stats=stats, tokens=tokens, aux=out.aux_hidden[:, path])
