"""`vat prep affinity`: counts against a brute-force loop, smoothing (rows sum to top_k), draft-id rows, CLI."""

from __future__ import annotations

import datasets
import pytest
import torch
from helpers import build_small_tokenizer
from safetensors import safe_open
from tiny_models import tiny_model

from vat.affinity import OnlineAffinity
from vat.cli import build_parser
from vat.cli import main as vat_main
from vat.data_prep.affinity import affinity_from_routing, routing_counts
from vat.data_prep.affinity import main as affinity_main
from vat.data_prep.vocab import build_draft_vocab, draft_to_target_ids, save_draft_vocab, target_to_draft_ids
from vat.errors import VatError
from vat.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


V, L, E, K = 20, 3, 6, 2


def _random_routing(seed=0, batch=3, length=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (batch, length), generator=g)  # tokens 12..19 never occur
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L * batch * length)]).view(
        L, batch, length, K
    )
    valid = torch.rand(batch, length, generator=g) > 0.2
    return ids, topk, valid


def test_counts_match_brute_force():
    ids, topk, valid = _random_routing()
    stats = routing_counts(ids, topk, valid, V, E)
    counts = torch.zeros(V, L, E, dtype=torch.int64)
    token_counts = torch.zeros(V, dtype=torch.int64)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if not valid[b, t]:
                continue
            token_counts[ids[b, t]] += 1
            for layer in range(L):
                for e in topk[layer, b, t]:
                    counts[ids[b, t], layer, e] += 1
    assert stats.counts.dtype == torch.int32  # half the bytes of int64; exact below 2^31 counted tokens
    assert torch.equal(stats.counts.long(), counts) and torch.equal(stats.token_counts, token_counts)
    assert stats.total == int(valid.sum())
    assert torch.equal(stats.marginal_counts, counts.sum(0))
    big = routing_counts(ids, topk, valid, V, E, into=type(stats)(stats.counts.clone(), stats.token_counts.clone(),
                                                                  stats.marginal_counts.clone(), 2**31 - 2))
    assert big.counts.dtype == torch.int64 and torch.equal(big.counts, 2 * counts)  # widened before it could overflow


@pytest.mark.parametrize("alpha", [1.0, 4.0])
def test_rows_sum_to_top_k_for_seen_and_unseen_tokens(alpha):
    ids, topk, valid = _random_routing(seed=1)
    table, token_counts = affinity_from_routing(ids, topk, valid, V, E, alpha=alpha)
    assert table.shape == (V, L, E) and table.dtype == torch.float32
    assert torch.allclose(table.sum(-1), torch.full((V, L), float(K)), atol=1e-5)
    unseen = token_counts == 0
    assert unseen[12:].all()
    marginal = routing_counts(ids, topk, valid, V, E).marginal(K).float()
    assert torch.allclose(table[unseen], marginal.expand(int(unseen.sum()), L, E), atol=1e-6)  # unseen = marginal
    # A frequent token moves toward its own empirical routing as alpha shrinks.
    v = int(token_counts.argmax())
    own = routing_counts(ids, topk, valid, V, E).counts[v].double() / token_counts[v]
    far = affinity_from_routing(ids, topk, valid, V, E, alpha=100.0)[0][v]
    assert (table[v] - own).abs().sum() < (far - own).abs().sum()


def test_dropped_slots_are_not_counted():
    ids, topk, valid = _random_routing(seed=2)
    dropped = topk.clone()
    dropped[..., -1] = E  # the target marks a dropped slot with num_experts
    stats = routing_counts(ids, dropped, valid, V, E)
    assert int(stats.counts.sum()) == int(valid.sum()) * L * (K - 1)


def test_draft_rows_equal_target_rows_of_their_ids():
    ids, topk, valid = _random_routing(seed=3)
    d2t, t2d = build_draft_vocab(torch.bincount(ids.flatten(), minlength=V), 8)
    by_target, _ = affinity_from_routing(ids, topk, valid, V, E)
    by_draft, counts = affinity_from_routing(ids, topk, valid, target_to_draft_ids(t2d), E)
    assert by_draft.shape == (8, L, E)
    assert torch.allclose(by_draft, by_target[draft_to_target_ids(d2t)])


def affinity_args(target_dir, data, out, *extra: str) -> list[str]:
    """`vat prep affinity` arguments: a target directory and a saved dataset in, ``out`` written, then ``extra``."""
    return ["prep", "affinity", "--target", str(target_dir), "--data", str(data), "--output", str(out), *extra]


def test_cli_affinity_with_tiny_olmoe(tmp_path, capsys):
    model = tiny_model("olmoe", num_experts=8, top_k=2)
    target_dir = tmp_path / "target"
    model.save_pretrained(str(target_dir))
    build_small_tokenizer().save_pretrained(str(target_dir))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (7, 12, 5, 9)]
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": rows,
            "loss_mask": [[1] * len(r) for r in rows],
            "length": [len(r) for r in rows],
            "id": ["a", "b", "c", "d"],
        }
    )
    data = tmp_path / "data"
    ds.save_to_disk(str(data))
    out = tmp_path / "aff.safetensors"
    assert vat_main(affinity_args(target_dir, data, out, "--batch-size", "3")) == 0
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        table, counts, layers = f.get_tensor("affinity"), f.get_tensor("token_counts"), f.get_tensor("layers")
    assert table.shape == (128, 2, 8) and layers.tolist() == [0, 1]
    assert meta["indexed_by"] == "target_id" and meta["top_k"] == "2" and meta["num_experts"] == "8"
    assert int(counts.sum()) == sum(len(r) for r in rows) == int(meta["tokens"])
    assert torch.allclose(table.sum(-1), torch.full((128, 2), 2.0), atol=1e-5)
    # Same routing as a direct forward of the frozen target (batching/padding must not change it).
    tgt = load_target(model, dtype="float32")
    direct = None
    for r in rows:
        x = torch.tensor([r])
        direct = routing_counts(x, tgt.forward(x, output_aux=False).topk_ids, None, 128, 8, into=direct)
    assert torch.equal(counts, direct.token_counts) and torch.allclose(table, direct.affinity(2), atol=1e-6)
    # Draft-id rows with --vocab and one layer; the trainer's OnlineAffinity loads the file as is.
    d2t, t2d = build_draft_vocab(direct.token_counts, 16)
    save_draft_vocab(str(tmp_path / "vocab.safetensors"), d2t, t2d)
    out2 = tmp_path / "aff_draft.safetensors"
    assert vat_main(affinity_args(target_dir, data, out2, "--vocab", str(tmp_path / "vocab.safetensors"), "--layers", "1")) == 0
    online = OnlineAffinity.from_file(str(out2), top_k=2)
    assert online.table().shape == (16, 1, 8)
    full_layer1 = torch.stack([direct.affinity(2)[:, 1]], dim=1)  # (V, 1, E); the marginal is per layer
    assert torch.allclose(online.table(), full_layer1[draft_to_target_ids(d2t)], atol=1e-6)
    assert "draft_id rows" in capsys.readouterr().out
    bad = affinity_args(target_dir, data, out2, "--layers", "5")
    with pytest.raises(VatError, match="not MoE layers"):
        affinity_main(build_parser().parse_args(bad))
