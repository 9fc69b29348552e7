"""What the trainer asks of a drafter kind: the one interface an EAGLE-3 head and a DFlash block drafter (and any new
kind) implement, so the training loop has no per-kind branches. A kind lives in its own module of
:mod:`vat.train.kinds` and is added to the registry there with one line."""

from __future__ import annotations

from typing import Any

import torch

from vat.errors import VatError


class DrafterKind:
    """One kind of draft, as the trainer builds, feeds and checks it.

    Attributes:
        name: the recipe's ``drafter.kind``.
        title: its name in messages.
        full_vocab: the draft predicts over the target's whole vocabulary (no draft vocabulary, ``data.vocab`` unset).
        supports_lora: ``train.lora`` can adapt its decoder layers.
        schedule: its base weight schedule over slots (:class:`vat.losses.LossSwitches` ``kind``: ``eagle3``,
            decay^k, or ``dflash``, exp(-k / gamma)).
    """

    name: str = ""
    title: str = ""
    full_vocab: bool = False
    supports_lora: bool = False
    schedule: str = "eagle3"

    def new(self, cfg: Any, target: Any, vocab_path: str | None) -> torch.nn.Module:
        """A freshly initialised draft sized from the target and the recipe's ``drafter.*`` keys (seeded)."""
        raise NotImplementedError

    def import_from(self, cfg: Any, target: Any) -> tuple[torch.nn.Module, str]:
        """``train.init_from``: the source draft's architecture and weights; returns the draft and one line that
        says what was imported."""
        raise NotImplementedError

    def check(self, draft_config: Any, target: Any) -> None:
        """Raise :class:`VatError` in one line when a saved draft's config does not fit this target."""
        raise NotImplementedError

    def num_slots(self, cfg: Any, draft_config: Any) -> int:
        """Draft positions per anchor in the (B, anchors, K) slot layout: K."""
        raise NotImplementedError

    def training_slots(self, drafter: Any, draft_config: Any, cfg: Any, batch: dict[str, torch.Tensor], tout: Any,
                       dist: Any, num_experts: int, anchor_seed: int, autocast: Any) -> Any:
        """The draft's training forward on a batch in the :mod:`vat.slots` layout. ``drafter`` is the module to call
        (wrapped by accelerate under DDP / FSDP: read its settings from ``draft_config``). ``anchor_seed`` seeds any
        sampling of anchors (the global data position: the same on resume and at any world size); ``autocast`` is
        the accelerator's autocast context factory."""
        raise NotImplementedError


def check_vocab_setting(kind: DrafterKind, vocab_path: str | None) -> None:
    """A full-vocabulary kind takes no draft vocabulary: ``data.vocab`` set for it is a mistake, said in one line."""
    if kind.full_vocab and vocab_path is not None:
        raise VatError(f"config key `data.vocab` is set ({vocab_path}) but a {kind.title} draft predicts over the "
                       "target's full vocabulary through its LM head; unset data.vocab")
