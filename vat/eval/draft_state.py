"""The draft's persistent state across speculative-decoding rounds: its KV cache and the head of the sequence.

Each committed position s contributes one draft entry (target aux state at s, token s + 1), computed once: after a
round, the entries of the newly accepted positions are appended (:meth:`DraftState.extend`); speculative entries
made while drafting a chain or tree are cropped before the round's verification. Nothing is recomputed from scratch.
A sliding-window draft's attention window is applied inside :meth:`Eagle3Drafter.step` from the cached RoPE positions,
so chains and trees get it without masks built here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vat.drafters.eagle3 import Eagle3Drafter, Eagle3KVCache, map_draft_probs_to_target


@dataclass
class DraftHead:
    """The draft's output at the newest committed entry: what the next chain or tree starts from.

    Attributes:
        hidden: (H,) the entry's recurrent state (pre-norm hidden, or its norm for ``norm_output`` drafts), fed to
            the first drafted token's entry.
        logits: (V_d,) draft logits for the token after the pending root.
        vh_logit: verification-head logit for that prediction, or None without a head.
        position: RoPE position of the entry (the root's drafted children sit at ``position + 1``).
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    vh_logit: float | None
    position: int


class DraftState:
    """An EAGLE-3 draft plus its KV cache for one sequence (batch size 1).

    Args:
        drafter: the draft (with its embedding attached).
        temperature: drafting temperature (0 = greedy).
    """

    def __init__(self, drafter: Eagle3Drafter, temperature: float = 0.0):
        self.drafter = drafter
        self.temperature = temperature
        self.cache: Eagle3KVCache = drafter.new_cache(1)

    @property
    def vocab_size(self) -> int:
        """The target vocabulary size V."""
        return int(self.drafter.config.vocab_size)

    @torch.no_grad()
    def extend(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor) -> DraftHead:
        """Append the entries of newly committed positions and return the head at the last one.

        Args:
            aux_hidden: (1, n, 3*H_t) target aux states of the committed positions.
            next_tokens: (1, n) the token following each of them (target vocabulary).

        Returns:
            The :class:`DraftHead` at the last new entry.
        """
        out = self.drafter.step(self.cache, next_tokens, aux_hidden=aux_hidden)
        vh = None if out.vh_logits is None else float(out.vh_logits[0, -1])
        position = int(self.cache.positions[0, -1])
        return DraftHead(hidden=out.hidden[0, -1], logits=out.logits[0, -1], vh_logit=vh, position=position)

    def scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits at the drafting temperature (unchanged when greedy), fp32."""
        return logits.float() / self.temperature if self.temperature > 0 else logits.float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids."""
        return self.drafter.map_draft_to_target(draft_ids)

    def target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """(…, V_d) draft-vocab probabilities -> (…, V) over the target vocabulary."""
        return map_draft_probs_to_target(probs, self.drafter.d2t, self.vocab_size)
