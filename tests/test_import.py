"""Importing EAGLE-3 drafts (``train.init_from`` / ``load_draft``): every layout and flag reproduces the source's logits.

Sources are written here, by hand (configs as SpecForge / speculators write them, for every combination of
norm_before_residual x {none, norm_before_fc, fc_norm} x norm_output x sliding window, in both engine layouts, with
d2t / t2d and target_hidden_size present or absent and aux ids in each layout's convention) and by exporting vat
drafts. The expected logits come from :func:`reference_ttt` / :func:`reference_chain`: plain float64 torch ops over
the raw weight tensors, written from speculators' ``Eagle3DraftModel`` / ``Eagle3FirstLayerMixin`` and its attention
masks, not from vat's modules.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.errors import VatError
from vat.export import export_sglang, export_speculators, init_draft_from, load_draft, save_draft

H, HEADS, KV, HD, INTER, V, VD, HT, EPS, THETA = 32, 4, 2, 8, 48, 80, 40, 24, 1e-6, 10000.0
NUM_LAYERS = 12
WINDOW = 3
MIDLAYER = (
    "input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight",
)


# ----------------------------------------------------------------------------------------------------------------------
# The independent reference: speculators' EAGLE-3 forward, in float64 over raw tensors
# ----------------------------------------------------------------------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd) rotated at integer positions pos (T,) — HF Llama rotate-half, default schedule."""
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = pos.double()[:, None] * inv[None]  # (T, hd/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q (B, HEADS, Tq, hd), k/v (B, KV, S, hd), allowed (Tq, S) bool -> (B, Tq, HEADS*hd). GQA: head i reads KV
    head i // (HEADS // KV), as HF's repeat_kv."""
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HD)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, -1) @ v  # (B, HEADS, Tq, hd)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], HEADS * HD)


def fc_input(w: dict, flags: dict, aux: torch.Tensor) -> torch.Tensor:
    a = aux.double()
    if flags["norm_before_fc"]:
        a = rms(a, w["input_norm.weight"])
    if flags["fc_norm"]:
        a = torch.cat([rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(a.chunk(3, -1))], -1)
    return a @ w["fc.weight"].double().T


def layer_entry(w: dict, flags: dict, embeds: torch.Tensor, g: torch.Tensor, pos: torch.Tensor):
    """Eagle3FirstLayerMixin up to attention: -> q, k, v (rotated), residual."""
    normed = rms(g, w["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), normed], -1)
    B, T = x.shape[:2]
    q = (x @ w["midlayer.self_attn.q_proj.weight"].double().T).view(B, T, HEADS, HD).transpose(1, 2)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].double().T).view(B, T, KV, HD).transpose(1, 2)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].double().T).view(B, T, KV, HD).transpose(1, 2)
    residual = normed if flags["norm_before_residual"] else g.double()
    return rope(q, pos), rope(k, pos), v, residual


def layer_exit(w: dict, flags: dict, attn: torch.Tensor, residual: torch.Tensor):
    """o_proj + residual, MLP, final norm -> (state fed to the next step, logits)."""
    h = residual + attn @ w["midlayer.self_attn.o_proj.weight"].double().T
    m = rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].double().T, m @ w["midlayer.mlp.up_proj.weight"].double().T
    h = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].double().T
    normed = rms(h, w["norm.weight"])
    return (normed if flags["norm_output"] else h), normed @ w["lm_head.weight"].double().T


def reference_ttt(w: dict, flags: dict, embed: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor, K: int):
    """speculators' TTT unroll: positions start at 1 and step k adds k; step-0 keys causal within the sliding window
    by index (``kv > q - window``); one diagonal key per earlier step. -> logits (B, T, K, V_d), float64."""
    B, T = ids.shape
    g = fc_input(w, flags, aux)
    idx = torch.arange(T)
    block0 = idx[None, :] <= idx[:, None]
    if flags["sliding_window"]:
        block0 &= idx[None, :] > idx[:, None] - flags["sliding_window"]
    keys, values, out = [], [], []
    for k in range(K):
        tok = torch.cat([ids[:, 1 + k :], ids.new_zeros(B, min(1 + k, T))], 1)[:, :T]  # token t+1+k
        q, kk, vv, residual = layer_entry(w, flags, embed.double()[tok], g, 1 + idx + k)
        keys.append(kk)
        values.append(vv)
        allowed = torch.cat([block0] + [torch.eye(T, dtype=torch.bool)] * k, 1)  # (T, (k+1)T)
        attn = attend(q, torch.cat(keys, 2), torch.cat(values, 2), allowed)
        g, logits = layer_exit(w, flags, attn, residual)
        out.append(logits)
    return torch.stack(out, 2)


def reference_chain(w: dict, flags: dict, embed: torch.Tensor, d2t: torch.Tensor, aux, ids, n: int, K: int):
    """Serving-style KV-cached greedy chain for one row: prefix entries (aux_s, x_{s+1}) at positions s < n, then K-1
    drafted entries; every query sees keys whose position is within the window of its own. -> (K, V_d) logits."""
    W = flags["sliding_window"] or 10**9
    g = fc_input(w, flags, aux[:, :n])
    pos = torch.arange(n)
    q, k, v, residual = layer_entry(w, flags, embed.double()[ids[:, 1 : n + 1]], g, pos)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < W)
    state, logits = layer_exit(w, flags, attend(q, k, v, allowed), residual)
    state, logits = state[:, -1:], logits[:, -1]
    keys, values, kpos, out = [k], [v], [pos], [logits]
    for step in range(1, K):
        token = torch.argmax(logits, -1) + d2t[torch.argmax(logits, -1)]  # draft id -> target id
        p = torch.tensor([n - 1 + step])
        q, k1, v1, residual = layer_entry(w, flags, embed.double()[token][:, None], state, p)
        keys.append(k1)
        values.append(v1)
        kpos.append(p)
        allowed = (p[:, None] - torch.cat(kpos)[None, :]) < W
        state, logits = layer_exit(w, flags, attend(q, torch.cat(keys, 2), torch.cat(values, 2), allowed), residual)
        state, logits = state, logits[:, 0]
        out.append(logits)
    return torch.cat(out, 0)


# ----------------------------------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------------------------------


def random_weights(flags: dict, ht: int, vd: int, seed: int) -> dict[str, torch.Tensor]:
    """Raw draft tensors under SGLang names; norms away from 1 so every norm placement changes the logits."""
    g = torch.Generator().manual_seed(seed)

    def lin(o, i):
        return torch.randn(o, i, generator=g) * i**-0.5

    def norm(n):
        return 1.0 + 0.3 * torch.randn(n, generator=g)

    w = {
        "fc.weight": lin(H, 3 * ht),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": lin(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": lin(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": lin(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": lin(H, HEADS * HD),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.mlp.gate_proj.weight": lin(INTER, H),
        "midlayer.mlp.up_proj.weight": lin(INTER, H),
        "midlayer.mlp.down_proj.weight": lin(H, INTER),
        "norm.weight": norm(H),
        "lm_head.weight": lin(vd, H),
    }
    if flags["norm_before_fc"]:
        w["input_norm.weight"] = norm(3 * ht)
    if flags["fc_norm"]:
        w.update({f"fc_norm.{i}.weight": norm(ht) for i in range(3)})
    if vd < V:
        used = torch.sort(torch.randperm(V, generator=g)[:vd]).values
        w["d2t"] = used - torch.arange(vd)
        w["t2d"] = torch.zeros(V, dtype=torch.bool)
        w["t2d"][used] = True
    return w


def llama_config(flags: dict) -> dict:
    """A draft layer config as transformers 5 serialises a LlamaConfig (``rope_parameters``, no head_dim default)."""
    data = {
        "model_type": "llama", "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": EPS,
        "rope_parameters": {"rope_theta": THETA, "rope_type": "default"}, "max_position_embeddings": 2048,
        "vocab_size": V, "tie_word_embeddings": False,
    }
    if flags["sliding_window"]:  # as speculators' create_transformer_layer_config writes it
        data.update(sliding_window=flags["sliding_window"], use_sliding_window=True, layer_types=["sliding_attention"])
    return data


def write_source(directory, layout: str, flags: dict, w: dict, embed: torch.Tensor, ht: int, vd: int, vllm_ids):
    """A hand-written draft directory in ``layout`` (no vat block), as SpecForge / speculators write them."""
    os.makedirs(directory)
    if layout == "sglang":  # SpecForge: Llama keys at top level, ids in eagle_config (layer outputs)
        config = {"architectures": ["LlamaForCausalLMEagle3"], **llama_config(flags), "draft_vocab_size": vd,
                  "norm_before_residual": flags["norm_before_residual"], "norm_before_fc": flags["norm_before_fc"],
                  "fc_norm": flags["fc_norm"], "norm_output": flags["norm_output"],
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in vllm_ids]}}
        tensors = {(f"model.{k}" if k.startswith("midlayer.") else k): v for k, v in w.items()}
    else:  # speculators: nested layer config, vLLM ids, layers.0.*, the embedding shipped
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": vd,
                  "norm_before_residual": flags["norm_before_residual"], "norm_before_fc": flags["norm_before_fc"],
                  "fc_norm": flags["fc_norm"], "norm_output": flags["norm_output"], "embed_requires_grad": False,
                  "eagle_aux_hidden_state_layer_ids": list(vllm_ids), "transformer_layer_config": llama_config(flags),
                  "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                      {"proposal_type": "greedy", "speculative_tokens": 3}], "verifier": {"name_or_path": "t"}}}
        tensors = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in w.items()}
        tensors["embed_tokens.weight"] = embed
    if ht != H:
        config["target_hidden_size"] = ht
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
    return str(directory)


def inputs(ht: int, B: int = 2, T: int = 9, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 3 * ht, generator=g), torch.randint(0, V, (B, T), generator=g)


def assert_ttt_matches(model: Eagle3Drafter, w: dict, flags: dict, embed: torch.Tensor, ht: int, K: int = 3):
    aux, ids = inputs(ht)
    with torch.no_grad():
        got = model.ttt_forward(aux, ids, ttt_steps=K).logits  # (B, T, K, V_d)
    want = reference_ttt(w, flags, embed, aux, ids, K)
    T = ids.shape[1]
    for k in range(K):  # steps whose input token exists (later ones read padding, by convention differently)
        torch.testing.assert_close(got[:, : T - 1 - k, k].double(), want[:, : T - 1 - k, k], atol=2e-4, rtol=1e-4)


FC_MODES = {"plain": {}, "norm_before_fc": {"norm_before_fc": True}, "fc_norm": {"fc_norm": True}}
COMBOS = [
    {"norm_before_residual": nbr, "norm_before_fc": False, "fc_norm": False, **FC_MODES[fc], "norm_output": nout,
     "sliding_window": win, "_id": f"{layout}-nbr{int(nbr)}-{fc}-nout{int(nout)}-win{win or 0}", "_layout": layout}
    for layout, nbr, fc, nout, win in itertools.product(
        ("sglang", "speculators"), (False, True), FC_MODES, (False, True), (None, WINDOW))
]


@pytest.mark.parametrize("combo", COMBOS, ids=[c["_id"] for c in COMBOS])
def test_hand_written_source_reproduces_reference_logits(tmp_path, combo):
    i = COMBOS.index(combo)
    layout = combo["_layout"]
    flags = {k: v for k, v in combo.items() if not k.startswith("_")}
    with_d2t, with_target_hidden = i % 2 == 0, (i // 2) % 2 == 0  # every layout sees each value of both
    vd, ht = (VD if with_d2t else V), (HT if with_target_hidden else H)
    w = random_weights(flags, ht, vd, seed=i)
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(100 + i))
    vllm_ids = [2, 6, 9] if i % 3 else [1, 5, NUM_LAYERS]  # vLLM convention; NUM_LAYERS = the final layer's output
    src = write_source(tmp_path / "src", layout, flags, w, embed, ht, vd, vllm_ids)

    model, cfg = load_draft(src, embed_weight=embed)
    # SGLang's draft always recurs on the pre-norm hidden: a foreign SGLang config's norm_output does not change it
    expected = dict(flags, norm_output=flags["norm_output"] and layout == "speculators")
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.aux_layer_ids == [i - 1 for i in vllm_ids]  # both conventions land on vat's layer-output ids
    assert (cfg.draft_vocab_size, cfg.target_hidden_size) == (vd, ht)
    assert_ttt_matches(model, w, expected, embed, ht)


def vat_weights(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_vat_draft(seed: int = 0, **flags) -> Eagle3Drafter:
    cfg = Eagle3Config(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV,
                       head_dim=HD, target_hidden_size=HT, vocab_size=V, draft_vocab_size=VD, rope_theta=THETA,
                       rms_norm_eps=EPS, aux_layer_ids=[1, 5, 8], num_target_layers=NUM_LAYERS, ttt_steps=3, **flags)
    g = torch.Generator().manual_seed(seed)
    w = random_weights({"norm_before_fc": cfg.norm_before_fc, "fc_norm": cfg.fc_norm}, HT, VD, seed)
    model = Eagle3Drafter(cfg, torch.randn(V, H, generator=g))
    model.load_state_dict(w, strict=False)
    model.set_vocab_mapping(w["d2t"], w["t2d"])
    return model.eval()


EXPORT_FLAGS = [
    dict(),
    dict(norm_before_residual=True, norm_before_fc=True, norm_output=True, sliding_window=WINDOW),  # speculators' own
    dict(fc_norm=True, norm_output=True),
    dict(norm_before_residual=True, sliding_window=WINDOW, verification_head=True),
]


@pytest.mark.parametrize("flags", EXPORT_FLAGS, ids=["default", "speculators_recipe", "fcnorm_nout", "nbr_win_vh"])
@pytest.mark.parametrize("layout", ["vat", "sglang", "speculators"])
def test_exported_vat_draft_reproduces_reference_logits(tmp_path, flags, layout):
    model = make_vat_draft(**flags)
    writer = {"vat": lambda m, d: save_draft(m, None, d), "sglang": export_sglang, "speculators": export_speculators}
    with pytest.warns(UserWarning) if layout == "sglang" and flags else _no_check():
        out = writer[layout](model, str(tmp_path / layout))
    loaded, cfg = load_draft(out, embed_weight=model.embed_tokens.weight)
    assert cfg == model.config  # every flag round-trips, whatever the engine does with it
    full = {k: getattr(cfg, k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    full["sliding_window"] = cfg.sliding_window
    assert_ttt_matches(loaded, vat_weights(model), full, model.embed_tokens.weight, HT)
    if layout == "speculators":  # speculators' key for the input embedding: the target's table, exactly
        assert torch.equal(load_file(os.path.join(out, "model.safetensors"))["embed_tokens.weight"],
                           model.embed_tokens.weight)


class _no_check:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("flags", [dict(sliding_window=WINDOW, norm_output=True), dict(sliding_window=WINDOW,
                                   norm_before_residual=True, norm_before_fc=True)], ids=["win_nout", "win_nbr_nbfc"])
def test_kv_cached_chain_applies_the_window_by_position(flags):
    """eval's path (Eagle3Drafter.step / draft_chain) against the serving-style reference, prefix longer than W."""
    model = make_vat_draft(**flags)
    aux, ids = inputs(HT, B=1, T=12)
    n, K = 8, 4
    cache = model.new_cache(1)
    model.step(cache, ids[:, 1:4], aux_hidden=aux[:, :3])  # extended in two chunks, as the engine does
    draft = model.draft_chain(cache, aux[:, 3:n], ids[:, 4 : n + 1], K)
    full = {k: getattr(model.config, k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    full["sliding_window"] = WINDOW
    want = reference_chain(vat_weights(model), full, model.embed_tokens.weight, model.d2t, aux, ids, n, K)
    torch.testing.assert_close(draft.logits[0].double(), want, atol=2e-4, rtol=1e-4)
    wide = make_vat_draft(**dict(flags, sliding_window=None))
    assert not torch.allclose(wide.draft_chain(wide.new_cache(1), aux[:, :n], ids[:, 1 : n + 1], K).logits,
                              draft.logits, atol=1e-3)  # the window changes the numbers


# ----------------------------------------------------------------------------------------------------------------------
# Checks against the target
# ----------------------------------------------------------------------------------------------------------------------


def fit(directory, embed, **overrides):
    args = dict(target_hidden_size=HT, target_vocab_size=V, num_target_layers=NUM_LAYERS, aux_layer_ids=[1, 5, 8],
                embed_weight=embed, verification_head=False)
    args.update(overrides)
    return init_draft_from(str(directory), **args)


def test_init_from_keeps_the_source_and_adds_or_drops_the_head(tmp_path):
    model = make_vat_draft(norm_output=True, sliding_window=WINDOW)
    src = export_speculators(model, str(tmp_path / "spec"))
    embed = model.embed_tokens.weight
    plain = fit(src, embed, ttt_steps=5)
    assert plain.training and plain.verification_head is None and plain.config.ttt_steps == 5
    body = vat_weights(model)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in body.items())
    with_head = fit(src, embed, verification_head=True)
    assert with_head.verification_head is not None and with_head.config.verification_head
    assert torch.count_nonzero(with_head.verification_head.weight) == 0  # fresh: the prior, no gradient into the body
    assert all(torch.equal(with_head.state_dict()[k], v) for k, v in body.items())


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(target_hidden_size=2 * HT), f"draft target_hidden_size {HT} ≠ target hidden_size {2 * HT}"),
        (dict(target_vocab_size=V + 1), f"draft vocab_size {V} ≠ target vocab_size {V + 1}"),
        (dict(num_target_layers=6), f"draft num_target_layers {NUM_LAYERS} ≠ target layers 6"),
        (dict(aux_layer_ids=[1, 5, 9]), r"draft aux layers \[1, 5, 8\] ≠ the target's captured layers \[1, 5, 9\]"),
        (dict(embed_weight=torch.zeros(V, H + 8)), f"draft hidden_size {H} ≠ target embedding width {H + 8}"),
        (dict(embed_weight=torch.zeros(V, H)), "differs from the target's embedding"),
    ],
    ids=["hidden", "vocab", "layers", "aux", "embed_width", "shipped_embedding"],
)
def test_mismatched_source_stops_with_one_line(tmp_path, overrides, message):
    model = make_vat_draft()
    src = export_speculators(model, str(tmp_path / "spec"))
    with pytest.raises(VatError, match=message) as err:
        fit(src, model.embed_tokens.weight, **overrides)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"init_from {src}: ")


def test_unsupported_source_variants_stop_with_one_line(tmp_path):
    model = make_vat_draft()
    src = export_speculators(model, str(tmp_path / "spec"))
    config = json.load(open(os.path.join(src, "config.json")))
    for change, message in (
        ({"model_type": "qwen3"}, "draft layer type 'qwen3' is not supported"),
        ({"layer_types": ["sliding_attention"], "sliding_window": None}, "sliding_window is None"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types lists 2 layers"),
    ):
        broken = json.loads(json.dumps(config))
        broken["transformer_layer_config"].update(change)
        json.dump(broken, open(os.path.join(src, "config.json"), "w"))
        with pytest.raises(VatError, match=message):
            load_draft(src)
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    (tmp_path / "no_embed").mkdir()
    bare = Eagle3Drafter(model.config)  # no embedding attached and no target recorded
    with pytest.raises(VatError, match="needs the target's input embedding"):
        export_speculators(bare, str(tmp_path / "no_embed"))
