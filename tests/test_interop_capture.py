"""speculators' data-generation output read as a vat capture, checked against the real ``speculators`` reader and
against the target itself (the quick tiny target).

Files are written in the layout speculators' ``ArrowDataset`` reads (``DIR/hidden_states/hs_{i}.safetensors`` with
``token_ids`` and ``hidden_states`` (T, 3 + 1, H): HF's hidden states at speculators' default layer ids, vLLM
convention, then the final norm's output, as vLLM hands them over). Then speculators' own ``ArrowDataset`` and vat's
:class:`vat.data_prep.capture_store.CaptureReader` must read the same tensors, and vat's capture-fed target must give
the target's own logits and aux features (vat's layer ids = vLLM's - 1).

Marker ``interop``: run in the second environment (docs/interop.md):

    bash scripts/interop_env.sh && .venv-interop/bin/python -m pytest -m interop tests/test_interop_capture.py
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from vat.data_prep.capture_store import CaptureReader
from vat.target.captured import load_captured_target
from vat.target.model import load_target

pytestmark = pytest.mark.interop

LENGTHS = (17, 33, 9)


def _arrow_dataset():
    """speculators' training dataset class; a loud failure (never a skip) when the package is missing."""
    try:
        from speculators.train.data import ArrowDataset
    except ImportError as err:
        pytest.fail(f"the interop tests need the real speculators ({err}): build the environment with "
                    "`bash scripts/interop_env.sh`", pytrace=False)
    return ArrowDataset


def test_speculators_hidden_states_read_by_speculators_and_by_vat_alike(tmp_path):
    arrow_dataset = _arrow_dataset()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from vat.data_prep.tiny_target import ensure_tiny_target

    path = ensure_tiny_target("quick")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = hf.config.num_hidden_layers
    vllm_ids = [2, layers // 2, layers - 3]  # speculators' default layer ids (vLLM: the input of layer i)
    frozen = load_target(hf, experts_impl="eager", aux_layer_ids=[i - 1 for i in vllm_ids])
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(8, hf.config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    os.makedirs(tmp_path / "hidden_states")
    for index, ids in enumerate(rows):
        with torch.no_grad():
            hidden = hf(input_ids=ids[None], output_hidden_states=True).hidden_states  # L + 1 of (1, T, H)
        final = frozen.forward(ids[None]).final_hidden[0]  # (T, H) the final norm's output
        stacked = torch.stack([hidden[i][0] for i in vllm_ids] + [final], dim=1)  # (T, 3 + 1, H)
        save_file({"token_ids": ids, "hidden_states": stacked.contiguous()},
                  str(tmp_path / "hidden_states" / f"hs_{index}.safetensors"))
    Dataset.from_dict({"input_ids": [r.tolist() for r in rows], "loss_mask": [[1] * len(r) for r in rows],
                       "seq_len": list(LENGTHS)}).with_format("torch").save_to_disk(str(tmp_path))

    theirs = arrow_dataset(max_len=64, datapath=str(tmp_path), on_missing="raise", hidden_states_dtype=torch.float32)
    reader = CaptureReader(str(tmp_path))
    target = load_captured_target(path, reader.target, dtype="float32", device="cpu",
                                  aux_layer_ids=[i - 1 for i in vllm_ids])
    assert not reader.has_routing and target.num_experts == frozen.num_experts
    for index, ids in enumerate(rows):
        mine, item = reader.sample(index), theirs[index]
        assert torch.equal(mine["aux"], item["hidden_states"])
        assert torch.equal(mine["last"], item["verifier_last_hidden_states"])
        features = reader.batch([index], ids[None], target.num_experts)
        out = target.forward_features(features["aux"], features["last"], features["routing"])
        online = frozen.forward(ids[None])
        torch.testing.assert_close(out.logits, online.logits, atol=1e-5, rtol=1e-5)  # a normed last state: no 2nd norm
        torch.testing.assert_close(out.aux_hidden, online.aux_hidden, atol=1e-5, rtol=1e-5)  # vLLM ids - 1 = vat's
