"""Interop with the real ``speculators`` library (vLLM's EAGLE-3 format), on the quick tiny target.

* vat's speculators export, loaded by speculators' own ``Eagle3DraftModel.from_pretrained``, gives vat's logits;
* a draft built by speculators' default EAGLE-3 recipe (its trainer's own config builder: ``norm_output``,
  ``norm_before_fc``, ``norm_before_residual``, sliding-window attention) and written by its ``save_pretrained``
  imports into vat (``load_draft`` and ``train.init_from``) with speculators' logits.

Both sides get the same inputs: token ids and the target's aux hidden states, taken for speculators from HF's
``output_hidden_states`` at the layer ids in its own config (vLLM convention) and for vat from its target wrapper
(vat convention), so the aux-layer conversion is checked too. Logits are compared over TTT steps 0..3 at every
anchor whose teacher-forced tokens are real: max |Δ| <= 1e-4 (fp32) and 100 % top-1 agreement.

Marker ``interop``: deselected by default; run in the second environment that has speculators (docs/interop.md):

    bash scripts/interop_env.sh && .venv-interop/bin/python -m pytest -m interop
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re

import pytest
import torch

from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.export import export_speculators, load_draft

pytestmark = pytest.mark.interop

SPECULATORS_VERSION = "0.9.0"
T = 129  # 128 draft anchors: speculators' default attention (flex) builds its mask in blocks of 128 positions
STEPS = 4  # TTT steps 0..3
DRAFT_VOCAB = 512  # < the tiny target's 4096, so d2t / t2d are exercised
ATOL = 1e-4
SMALL_WINDOW = 16  # < T, so the sliding window changes the logits


def _speculators():
    """speculators' EAGLE-3 classes; a loud failure (never a skip) when the package is missing."""
    try:
        from speculators.models.eagle3 import Eagle3DraftModel
    except ImportError as err:
        pytest.fail(
            f"the interop tests need the real speculators=={SPECULATORS_VERSION} ({err}): build the environment with "
            "`bash scripts/interop_env.sh` and run `.venv-interop/bin/python -m pytest -m interop`",
            pytrace=False,
        )
    return Eagle3DraftModel


# ----------------------------------------------------------------------------------------------------------------------
# Fixtures: the quick tiny target, one batch, its hidden states
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    """(path, HF model, vat FrozenTarget) of the quick tiny target (built into $VAT_HOME on first use)."""
    _speculators()
    from transformers import AutoModelForCausalLM

    from vat.data_prep.tiny_target import ensure_tiny_target
    from vat.target.model import load_target

    path = ensure_tiny_target("quick")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, load_target(hf, experts_impl="eager")


@pytest.fixture(scope="module")
def batch(target):
    """(ids (1, T), HF hidden states (L+1 of (1, T, H)), the target's input embedding (V, H))."""
    _, hf, _ = target
    vocab = hf.config.vocab_size
    ids = torch.randint(8, vocab, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden_states = hf(input_ids=ids, output_hidden_states=True).hidden_states
    return ids, hidden_states, hf.get_input_embeddings().weight.detach()


def vocab_mapping(vocab: int, draft_vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random draft vocabulary: (d2t (V_d,) offsets, t2d (V,) bool), the layout both libraries use."""
    used = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab), t2d


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int, skip: tuple[str, ...] = ()) -> None:
    """Weights far from init (norm gains around 1, matrices at std 0.05) so every flag and weight shows in the logits
    and top-1 has no near-ties; frozen tables named in ``skip`` stay as they are."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.startswith(skip):
            continue
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else 0.05 * noise)


def speculators_logits(model, hidden_states, ids: torch.Tensor) -> list[torch.Tensor]:
    """speculators' own TTT forward (its training/eval path, no loss); logits per step, (1, T-1, V_d) each.

    Its inputs are already shifted as its ``shift_batch`` does: aux state g_t pairs with token x_{t+1}; positions
    default to 1..T-1. ``forward`` returns only argmax tokens, so the logits are read at ``lm_head``.
    """
    aux = torch.cat([hidden_states[i] for i in model.config.eagle_aux_hidden_state_layer_ids], dim=-1)  # (1, T, 3H)
    caught: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: caught.append(out.detach().float()))
    try:
        with torch.no_grad():
            model(
                hidden_states=aux[:, :-1],
                input_ids=ids[:, 1:],
                document_ids=torch.zeros(1, ids.shape[1] - 1, dtype=torch.long),
                ttt_steps=STEPS,
            )
    finally:
        handle.remove()
    assert len(caught) == STEPS
    return caught


def vat_logits(draft: Eagle3Drafter, target, ids: torch.Tensor) -> torch.Tensor:
    """vat's TTT forward on the same batch: aux states from vat's target wrapper at the draft's (vat-convention) aux
    ids, RoPE positions 1..T as speculators uses. Returns (1, T, STEPS, V_d)."""
    _, _, frozen = target
    frozen.aux_layer_ids = list(draft.config.aux_layer_ids)
    with torch.no_grad():
        aux = frozen.forward(ids, capture_routing=False).aux_hidden  # (1, T, 3H)
        positions = torch.arange(1, ids.shape[1] + 1)[None]
        return draft.ttt_forward(aux, ids, ttt_steps=STEPS, position_ids=positions).logits.float()


def assert_same_logits(vat: torch.Tensor, spec: list[torch.Tensor]) -> None:
    """Step k, anchor t is compared while its teacher-forced token t+1+k is real (t < T-1-k)."""
    report, ok = [], True
    for k in range(STEPS):
        n = T - 1 - k
        a, b = vat[0, :n, k], spec[k][0, :n]
        assert b.abs().max() > 1.0, "logits too flat to compare top-1"
        delta = (a - b).abs().max().item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        report.append(f"step {k}: max|Δ| {delta:.2e}, top-1 {agree:.1%}")
        ok = ok and delta <= ATOL and agree == 1.0
    assert ok, "vat vs speculators: " + "; ".join(report)


# ----------------------------------------------------------------------------------------------------------------------
# The environment itself
# ----------------------------------------------------------------------------------------------------------------------


def test_interop_environment_is_the_documented_one():
    """speculators is the pinned release and transformers is the low end of pyproject's range (the README's tested
    range rests on this venv)."""
    _speculators()
    import tomllib  # Python >= 3.11, as the interop env (the main suite collects this file on 3.10 too)
    import transformers

    assert importlib.metadata.version("speculators") == SPECULATORS_VERSION
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    low = next(re.search(r">=\s*([\d.]+)", d).group(1) for d in deps if re.match(r"transformers\b", d))
    assert transformers.__version__ == low or transformers.__version__ == f"{low}.0", (
        f"the interop env should hold transformers {low} (pyproject's lower bound), has {transformers.__version__}"
    )


# ----------------------------------------------------------------------------------------------------------------------
# a. vat's export, loaded by speculators
# ----------------------------------------------------------------------------------------------------------------------

EXPORT_VARIANTS = {
    "eagle3": {},
    "norm_before_residual+fc_norm": dict(norm_before_residual=True, fc_norm=True),
    "speculators_default_flags": dict(
        norm_before_residual=True, norm_before_fc=True, norm_output=True, sliding_window=SMALL_WINDOW
    ),
}


@pytest.mark.parametrize("flags", list(EXPORT_VARIANTS.values()), ids=list(EXPORT_VARIANTS))
def test_vat_speculators_export_loads_in_speculators_with_vats_logits(target, batch, tmp_path, flags):
    Eagle3DraftModel = _speculators()
    path, hf, _ = target
    ids, hidden_states, embedding = batch
    cfg = Eagle3Config.for_target(hf.config, draft_vocab_size=DRAFT_VOCAB, ttt_steps=STEPS, target_path=path, **flags)
    draft = Eagle3Drafter(cfg, embed_weight=embedding)
    draft.set_vocab_mapping(*vocab_mapping(cfg.vocab_size, cfg.draft_vocab_size))
    randomize(draft, seed=2)
    draft.eval()

    out = export_speculators(draft, str(tmp_path / "spec"))
    loaded = Eagle3DraftModel.from_pretrained(out).eval()  # speculators' own loader, its default attention

    # what a silent load would get wrong: the embedding (zero-filled when missing), the vocab mapping, the flags
    assert torch.equal(loaded.embed_tokens.weight, embedding), "speculators loaded another embedding"
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert getattr(loaded.config, flag) == getattr(cfg, flag), flag
    if cfg.sliding_window is not None:
        assert loaded.uses_sliding_window_attn and loaded.sliding_window == cfg.sliding_window
    else:
        assert not loaded.uses_sliding_window_attn

    assert_same_logits(vat_logits(draft, target, ids), speculators_logits(loaded, hidden_states, ids))


# ----------------------------------------------------------------------------------------------------------------------
# b. speculators' default recipe, imported into vat
# ----------------------------------------------------------------------------------------------------------------------


def speculators_default_draft(verifier: str, d2t: torch.Tensor, t2d: torch.Tensor, **draft_flags):
    """A fresh draft exactly as ``speculators train --verifier-name-or-path VERIFIER`` builds it by default (its
    config schema's defaults, resolved as its CLI does, through its own ``build_draft_model``)."""
    Eagle3DraftModel = _speculators()
    from speculators.train import cli
    from speculators.train.config.schema import TrainConfig

    config = TrainConfig.model_validate(
        {"verifier": {"verifier_name_or_path": verifier}, "draft": {"draft_vocab_size": len(d2t), **draft_flags}}
    )
    args = argparse.Namespace(**config.flatten())
    return cli.build_draft_model(args, Eagle3DraftModel, t2d, d2t, len(d2t))


@pytest.mark.parametrize("window", [None, SMALL_WINDOW], ids=["default", f"sliding_window_{SMALL_WINDOW}"])
def test_speculators_default_recipe_draft_imports_into_vat_with_its_logits(target, batch, tmp_path, window):
    path, hf, frozen = target
    ids, hidden_states, embedding = batch
    d2t, t2d = vocab_mapping(hf.config.vocab_size, DRAFT_VOCAB, seed=3)
    spec = speculators_default_draft(path, d2t, t2d, **({"sliding_window": window} if window else {}))
    # the recipe this test is about: every flag speculators' EAGLE-3 default writes
    c = spec.config
    assert (c.norm_output, c.norm_before_fc, c.norm_before_residual) == (True, True, True)
    assert c.transformer_layer_config.layer_types == ["sliding_attention"]
    assert c.transformer_layer_config.sliding_window == (window or 2048)
    randomize(spec, seed=4, skip=("embed_tokens", "verifier_"))  # the embedding stays the target's (frozen)
    spec.eval()
    spec.save_pretrained(str(tmp_path / "spec"))
    reference = speculators_logits(spec, hidden_states, ids)

    draft, cfg = load_draft(str(tmp_path / "spec"), embed_weight=embedding)
    assert (cfg.norm_output, cfg.norm_before_fc, cfg.norm_before_residual) == (True, True, True)
    assert cfg.sliding_window == (window or 2048)
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    assert_same_logits(vat_logits(draft, target, ids), reference)

    # and through the trainer's import (train.init_from): the same draft, ready to continue training
    from vat.export.init_from import init_draft_from

    start = init_draft_from(
        str(tmp_path / "spec"),
        target_hidden_size=hf.config.hidden_size,
        target_vocab_size=hf.config.vocab_size,
        num_target_layers=hf.config.num_hidden_layers,
        aux_layer_ids=list(cfg.aux_layer_ids),
        embed_weight=embedding,
        verification_head=False,
    )
    assert_same_logits(vat_logits(start.eval(), target, ids), reference)
