"""`vat prep vocab`: frequency selection, tie-breaking, d2t/t2d convention, round trips, identity, CLI."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from vat.cli import main as vat_main
from vat.data_prep.vocab import (
    build_draft_vocab,
    count_tokens,
    draft_to_target_ids,
    load_draft_vocab,
    read_vocab_metadata,
    save_draft_vocab,
    target_to_draft_ids,
)
from vat.errors import VatError


def test_top_n_by_frequency_ties_to_lower_id_sorted_ascending():
    counts = torch.tensor([0, 5, 3, 5, 9, 3, 0, 1])
    d2t, t2d = build_draft_vocab(counts, 4)
    # 4 (9), 1 and 3 (5, 5), then 2 beats 5 (both 3) by lower id; stored ascending.
    used = draft_to_target_ids(d2t)
    assert used.tolist() == [1, 2, 3, 4]
    assert d2t.tolist() == [1, 1, 1, 1] and d2t.dtype == torch.int64
    assert t2d.tolist() == [False, True, True, True, True, False, False, False] and t2d.dtype == torch.bool


def test_unseen_ids_fill_lowest_first():
    counts = torch.tensor([0, 0, 7, 0, 0, 2])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 5]


def test_round_trip_target_draft_target(tmp_path):
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (300,), generator=gen)
    d2t, t2d = build_draft_vocab(counts, 64)
    path = tmp_path / "vocab.safetensors"
    save_draft_vocab(str(path), d2t, t2d)
    d2t2, t2d2 = load_draft_vocab(str(path))
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    meta = read_vocab_metadata(str(path))
    assert meta["target_vocab_size"] == "300" and meta["draft_vocab_size"] == "64"
    t_of_d = draft_to_target_ids(d2t2)  # (N,)
    d_of_t = target_to_draft_ids(t2d2)  # (V,)
    assert torch.equal(d_of_t[t_of_d], torch.arange(64))  # target -> draft -> target for every member
    members = torch.nonzero(t2d2).flatten()
    assert torch.equal(t_of_d[d_of_t[members]], members)
    assert (d_of_t[~t2d2] == -1).all() and int((d_of_t >= 0).sum()) == 64
    # The chosen ids are the most frequent ones: no excluded id is more frequent than an included one.
    assert counts[~t2d2].max() <= counts[t2d2].min()


@pytest.mark.parametrize("size", [10, 11, 1000])
def test_identity_when_size_covers_the_vocab(size):
    d2t, t2d = build_draft_vocab(torch.tensor([3, 0, 1, 0, 0, 0, 0, 0, 0, 2]), size)
    assert d2t.tolist() == [0] * 10 and t2d.all() and t2d.numel() == 10
    assert torch.equal(target_to_draft_ids(t2d), torch.arange(10))


def test_inconsistent_files_are_refused(tmp_path):
    with pytest.raises(VatError, match="disagree"):
        save_draft_vocab(str(tmp_path / "x.safetensors"), torch.tensor([0, 0]), torch.tensor([False, True, True]))
    with pytest.raises(VatError, match="not found"):
        load_draft_vocab(str(tmp_path / "missing.safetensors"))


def test_counts_only_loss_masked_tokens_and_cli(tmp_path, capsys):
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3, 4, 4], [5, 4, 6, 6, 6]],
            "loss_mask": [[0, 0, 1, 1, 1], [1, 0, 0, 1, 1]],
            "length": [5, 5],
            "id": ["a", "b"],
        }
    )
    counts = count_tokens(ds, 8)
    assert counts.tolist() == [0, 0, 0, 1, 2, 1, 2, 0]
    data = tmp_path / "data"
    ds.save_to_disk(str(data))
    (data / "stats.json").write_text(json.dumps({"tokenizer": None}))
    out = tmp_path / "v.safetensors"
    assert (
        vat_main(["prep", "vocab", "--data", str(data), "--size", "3", "--vocab-size", "8", "--output", str(out)]) == 0
    )
    d2t, t2d = load_draft_vocab(str(out))
    assert draft_to_target_ids(d2t).tolist() == [3, 4, 6]  # 4 and 6 (2 each), then 3 and 5 tie -> 3
    assert "covers 83.33% of 6 loss tokens" in capsys.readouterr().out
    code = vat_main(["prep", "vocab", "--data", str(data), "--size", "3", "--output", str(out)])
    assert code == 2 and "--vocab-size" in capsys.readouterr().err
