"""DFlash block drafting for the speculative-decoding engine.

A round: the draft drafts ``block_size - 1`` tokens in one forward from its context cache (the target's features at
every committed position before the root) and the root; the target verifies ``[root, d_1, ..., d_K]`` exactly as it
verifies an EAGLE-3 chain (:func:`vat.eval.chain.judge_chain`: longest matching prefix plus the bonus token at
T = 0, standard rejection sampling at T > 0), and the accepted positions' features extend the context.

Every slot's draft distribution is fixed by the context and the root alone (slots are drafted in parallel, not
conditioned on one another), so rejection sampling against it keeps the target's distribution exactly.
"""

from __future__ import annotations

import torch

from vat.drafters.dflash import DFlashCache, DFlashDrafter
from vat.eval.chain import ChainDraft


class BlockState:
    """A DFlash draft plus its context cache for one sequence (batch size 1).

    Args:
        drafter: the draft (with the target's embedding and LM head attached).
        temperature: drafting temperature (0 = greedy).
    """

    def __init__(self, drafter: DFlashDrafter, temperature: float = 0.0):
        self.drafter = drafter
        self.temperature = temperature
        self.cache: DFlashCache = drafter.new_cache(1)

    @torch.no_grad()
    def extend(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor | None = None) -> None:
        """Append the target features (1, n, n_ctx*H_t) of newly committed positions to the context.

        ``next_tokens`` is accepted for the engine's one call site and unused: a DFlash context entry is the target's
        features alone (the EAGLE-3 state pairs them with the following token).
        """
        self.drafter.extend_context(self.cache, aux_hidden)


@torch.no_grad()
def draft_block(
    state: BlockState,
    root: int,
    *,
    vh_threshold: float | None = None,
    generator: torch.Generator | None = None,
) -> ChainDraft:
    """Draft the block after the context: ``block_size - 1`` tokens, fewer when the verification head stops it.

    Args:
        state: the context cache (positions 0..n-1; the root sits at n).
        root: the newest committed token, the block's anchor.
        vh_threshold: truncate the block before the first slot whose verification-head probability is below this
            (a shorter verification block loads fewer experts); None = never.
        generator: randomness for sampled drafts (temperature > 0).

    Returns:
        A :class:`ChainDraft`: tokens (K',) and, when sampling, the distributions q (K', V) they were drawn from.
    """
    device = state.cache.keys[0].device
    out = state.drafter.draft_block(state.cache, torch.tensor([root], device=device))
    logits = out.logits[0, 0].float()  # (K, V)
    if vh_threshold is not None and out.vh_logits is not None:
        below = (torch.sigmoid(out.vh_logits[0, 0].float()) < vh_threshold).nonzero()
        if below.numel():
            logits = logits[: int(below[0, 0])]  # (K', V)
    vh = None
    if out.vh_logits is not None:
        vh = torch.sigmoid(out.vh_logits[0, 0].float())[: logits.shape[0]].tolist()  # (K',) per slot
    if state.temperature > 0:
        q = torch.softmax(logits / state.temperature, dim=-1)  # (K', V)
        tokens = torch.multinomial(q, 1, generator=generator).view(-1) if q.shape[0] else q.new_zeros(0).long()
        probs = q.gather(1, tokens[:, None]).view(-1).tolist()
        return ChainDraft(tokens=tokens, q=q, probs=probs, vh=vh)
    tokens = logits.argmax(dim=-1)  # (K',)
    probs = torch.softmax(logits, dim=-1).gather(1, tokens[:, None]).view(-1).tolist()
    return ChainDraft(tokens=tokens, q=None, probs=probs, vh=vh)
