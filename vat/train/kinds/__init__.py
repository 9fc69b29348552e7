"""The drafter kinds the trainer builds, by the recipe's ``drafter.kind``: one line each, ``name: "module:Class"``
(imported on first use, so an EAGLE-3 run never imports DFlash). A new kind is a module here that implements
:class:`vat.train.kinds.base.DrafterKind`, plus its line below."""

from __future__ import annotations

import importlib

from vat.config import closest_hint
from vat.errors import VatError
from vat.train.kinds.base import DrafterKind

DRAFTER_KINDS: dict[str, str] = {
    "eagle3": "vat.train.kinds.eagle3:Eagle3Kind",
    "dflash": "vat.train.kinds.dflash:DFlashKind",
}


def drafter_kind(name: str) -> DrafterKind:
    """The registered kind called ``name``; an unknown name fails in one line that names the closest."""
    if name not in DRAFTER_KINDS:
        raise VatError(f"config key `drafter.kind` must be one of {list(DRAFTER_KINDS)}, got `{name}`"
                       f"{closest_hint(str(name), list(DRAFTER_KINDS))}")
    module, cls = DRAFTER_KINDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
