"""AcceptMoE's offline commitment estimate p̂_d (``vat eval --policy acceptmoe --commitment FILE``).

p̂_d = the probability that the node at draft depth d of a verification block ends on the accepted path, for
d = 1, 2, ... (the root, d = 0, is always committed). For a chain, a DFlash block and a tree alike this is the
unconditional acceptance at position d of an earlier ``vat eval`` of the same draft at natural routing
(``accept_by_position.unconditional``: rounds that accepted at least d drafts / rounds that drafted): exactly one
node per depth is on the accepted path, so a tree's p̂_d is the probability that its path reaches depth d, and
AcceptMoE's N_d^{-1/2} shares it among the depth's nodes.

``FILE`` is either that ``eval.json`` (the pooled entry of the draft whose path matches the one being evaluated, else
its only trained draft, at budget ``none``), or a JSON list ``[p̂_1, p̂_2, ...]``. Without a file the prior
p̂_d = 0.8^d (:data:`vat.target.budget.DEFAULT_COMMITMENT_DECAY`) is used.
"""

from __future__ import annotations

import json
import os

from vat.errors import VatError, require_file

NATURAL = "none"
NOT_TRAINED = ("none", "ngram")


def load_commitment(path: str, draft_path: str | None = None) -> tuple[float, ...]:
    """p̂_1, p̂_2, ... from an eval.json or a JSON list.

    Args:
        path: the file.
        draft_path: the evaluated draft's directory (picks its entry in an eval.json holding several drafts).

    Returns:
        The probabilities, depth 1 first.
    """
    require_file(path, "commitment estimate")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise VatError(f"{path} is not JSON: {err}") from None
    if isinstance(data, list):
        values = data
    elif isinstance(data, dict) and "pooled" in data:
        values = _from_eval(data, path, draft_path)
    else:
        raise VatError(f"{path}: expected an eval.json of the same draft or a JSON list [p_1, p_2, ...]")
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise VatError(f"{path}: commitment probabilities must be numbers, got {values!r}") from None
    if not out:
        raise VatError(f"{path}: no acceptance by position to estimate commitment from")
    return out


def _from_eval(data: dict, path: str, draft_path: str | None) -> list:
    drafts = {label: rec for label, rec in data.get("drafts", {}).items() if label not in NOT_TRAINED}
    label = None
    if draft_path is not None:
        want = os.path.realpath(draft_path)
        label = next((lb for lb, rec in drafts.items() if rec.get("path") and os.path.realpath(rec["path"]) == want),
                     None)
    if label is None and len(drafts) == 1:
        label = next(iter(drafts))
    if label is None:
        raise VatError(f"{path} holds drafts {sorted(drafts)} and none is {draft_path}: pass a JSON list instead")
    entry = data["pooled"].get(label, {}).get(NATURAL)
    if entry is None:
        raise VatError(f"{path}: draft {label} was not evaluated at budget none (natural routing)")
    return [p for p in entry["accept_by_position"]["unconditional"] if p is not None]
