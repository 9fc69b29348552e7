"""The training-free drafts by name: vLLM's n-gram rule, the recent-occurrence n-gram variant, suffix decoding.

A free draft is named on the command line (``--draft``) and in a bench's ``baselines`` as:

* ``ngram``: prompt lookup with ``--ngram-rule`` / ``--ngram-min`` / ``--ngram-n`` (default vLLM's rule, n = 1..3);
* ``ngram-vllm-MIN-MAX`` / ``ngram-recent-MIN-MAX``: one point of the n-gram grid (e.g. ``ngram-vllm-5-5``, vLLM's
  default settings);
* ``suffix`` / ``suffix-dDEPTH`` / ``suffix-local``: suffix decoding with vLLM's defaults, another tree depth, or
  without the cache of the pass's earlier responses.

:data:`DEFAULT_GRID` is what a bench runs when it asks for ``free``: the table's "free baseline" is then the best of
them per benchmark, chosen on the dev split.
"""

from __future__ import annotations

import re

from vat.errors import VatError
from vat.eval.ngram import RULES, NgramSpec
from vat.eval.suffix import SuffixSpec

FREE_DRAFT_TYPES = (NgramSpec, SuffixSpec)
DEFAULT_GRID = ("ngram-vllm-1-3", "ngram-vllm-2-4", "ngram-vllm-3-5", "ngram-vllm-5-5", "ngram-recent-1-3", "suffix")
GRID_NAME = "free"  # a bench baseline that stands for the whole DEFAULT_GRID
_NGRAM = re.compile(r"^ngram-(?P<rule>[a-z]+)-(?P<min>\d+)-(?P<max>\d+)$")
_SUFFIX = re.compile(r"^suffix(?:-d(?P<depth>\d+))?(?P<local>-local)?$")


def is_free_draft(model) -> bool:
    """Whether ``model`` is a training-free draft spec (decoded by lookup, no forward of its own)."""
    return isinstance(model, FREE_DRAFT_TYPES)


def parse_free_draft(name: str, ngram_default: NgramSpec | None = None) -> NgramSpec | SuffixSpec | None:
    """The spec a free-draft name stands for; None when ``name`` is not one (a path, ``none``).

    Args:
        name: ``ngram``, ``ngram-RULE-MIN-MAX``, ``suffix``, ``suffix-dDEPTH``, ``suffix-local``.
        ngram_default: what plain ``ngram`` means (the ``--ngram-*`` flags); vLLM's rule, n = 1..3 when None.

    Raises:
        VatError: a name of the n-gram or suffix family that is malformed (one line, the grammar in it).
    """
    text = str(name).strip().lower()
    if text == "ngram":
        return ngram_default or NgramSpec()
    if (m := _NGRAM.match(text)) is not None:
        if m["rule"] not in RULES:
            raise VatError(f"unknown n-gram rule in `{name}`; expected ngram-{{{'|'.join(RULES)}}}-MIN-MAX")
        return NgramSpec(n_max=int(m["max"]), n_min=int(m["min"]), rule=m["rule"])
    if (m := _SUFFIX.match(text)) is not None:
        depth = int(m["depth"]) if m["depth"] else SuffixSpec().max_depth
        return SuffixSpec(max_depth=depth, use_global=not m["local"])
    if text.startswith(("ngram", "suffix")) and "/" not in text:
        raise VatError(f"bad free draft `{name}`: expected ngram, ngram-{{vllm|recent}}-MIN-MAX, suffix, "
                       "suffix-dDEPTH or suffix-local")
    return None


def expand_baselines(names) -> list[str]:
    """A bench's baselines with ``free`` replaced by :data:`DEFAULT_GRID` (order kept, duplicates dropped)."""
    out: list[str] = []
    for name in names:
        for n in (DEFAULT_GRID if str(name).lower() == GRID_NAME else (name,)):
            if n not in out:
                out.append(n)
    return out
