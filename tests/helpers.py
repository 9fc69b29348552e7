"""Helpers shared by several test modules: plain functions and constants, no fixtures (the shared fixtures are in
conftest.py, the tiny random MoE targets and their greedy reference in tiny_models.py). Test modules import them as
``from helpers import ...``, as they import ``tiny_models`` (pytest puts tests/ on ``sys.path``)."""

from __future__ import annotations

import json
import math
import os

import torch
from tiny_models import tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import PreTrainedTokenizerFast

from vat.config import load_config
from vat.drafters.dflash import DFlashConfig, DFlashDrafter
from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.target import load_target

# ---- EAGLE-3 drafts of the drafter and export unit tests (tiny dims) -------------------------------------------------

# target vocab, draft vocab, draft hidden size, target hidden size of the unit-test EAGLE-3 drafts
V, VD, H, HT = 128, 64, 64, 48


def eagle3_config(**overrides) -> Eagle3Config:
    """A 1-layer EAGLE-3 config over a target of hidden size HT (aux layers 1, 3, 4 of 8), vocab V, draft vocab VD."""
    values = dict(
        hidden_size=H,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_hidden_size=HT,
        vocab_size=V,
        draft_vocab_size=VD,
        aux_layer_ids=[1, 3, 4],
        num_target_layers=8,
        ttt_steps=3,
        rope_theta=10000.0,
    )
    values.update(overrides)
    return Eagle3Config(**values)


def eagle3_vocab_mapping(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random draft vocabulary of VD of the V target tokens: (d2t offsets, t2d mask)."""
    g = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(VD), t2d


def random_eagle3(cfg: Eagle3Config, seed: int = 0) -> Eagle3Drafter:
    """Random weights (norm weights too, so every norm placement matters) and a non-identity vocab mapping."""
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Drafter(cfg, torch.randn(V, H, generator=g))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:  # ~ unit-variance activations, as in a trained layer
                scale = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1
                p.copy_(scale * torch.randn(p.shape, generator=g))
    model.set_vocab_mapping(*eagle3_vocab_mapping(seed))
    return model.eval()


def aux_batch(B: int, T: int, seed: int, *, features: int, vocab: int, low: int = 0):
    """Random aux features (B, T, features) and token ids (B, T) in [low, vocab), from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, features, generator=g)
    ids = torch.randint(low, vocab, (B, T), generator=g)
    return aux, ids


def eagle3_batch(B: int = 2, T: int = 12, seed: int = 1):
    """Random aux features (B, T, 3 * HT) and token ids (B, T)."""
    return aux_batch(B, T, seed, features=3 * HT, vocab=V)


# ---- drafts for the engine tests on tiny targets ---------------------------------------------------------------------

def make_eagle3_draft(model, target, *, rigged: bool, vh: bool = False, seed: int = 0) -> Eagle3Drafter:
    """A random EAGLE-3 draft for ``target`` (the engine tests), or one rigged to often agree with the target.

    The rigged draft reads the target's last-layer output (aux slot 0 = layer 1 of a 2-layer target) through an
    identity ``fc``, adds nothing in its decoder layer (zero ``o_proj`` / ``down_proj``) and reuses the target's final
    norm and LM head: it proposes the target's previous prediction again (the root, repeated), which random tiny
    targets often do -- and often do not, so both accept and reject paths run.
    """
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(
        model.config, draft_vocab_size=model.config.vocab_size, aux_layer_ids=target.aux_layer_ids,
        verification_head=vh,
    )
    draft = Eagle3Drafter(cfg, target.embed_tokens().weight).eval()
    if rigged:
        hidden = cfg.hidden_size
        with torch.no_grad():
            draft.fc.weight.zero_()
            draft.fc.weight[:, :hidden] = torch.eye(hidden)
            draft.midlayer.self_attn.o_proj.weight.zero_()
            draft.midlayer.mlp.down_proj.weight.zero_()
            draft.norm.weight.copy_(model.model.norm.weight)
            draft.lm_head.weight.copy_(model.lm_head.weight)
    return draft


def make_dflash_draft(
    model, target, *, rigged: bool, block_size: int = 5, vh: bool = False, seed: int = 0
) -> DFlashDrafter:
    """A random 1-layer DFlash draft, or one rigged to draft the anchor token repeated in every slot.

    The rigged draft has no context (zero ``fc``), uniform attention (zero ``q_proj``), MASK slots that carry no value
    (``v_proj`` projects out the MASK token's normed embedding) and an ``o_proj`` that maps the anchor's value onto
    the target's LM-head row of the anchor, scaled to dominate the residual: every slot proposes the root again,
    which random tiny targets often repeat -- and often do not, so full, partial and zero acceptance all run.
    """
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(
        model.config, num_hidden_layers=1, block_size=block_size, mask_token_id=3, verification_head=vh,
        num_key_value_heads=model.config.num_attention_heads,
    )
    draft = DFlashDrafter(cfg, target.embed_tokens().weight, target.lm_head().weight).eval()
    target.aux_layer_ids = list(cfg.target_layer_ids)  # the features this draft reads
    if rigged:
        layer = draft.layers[0]
        with torch.no_grad():
            draft.fc.weight.zero_()
            layer.self_attn.q_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            x = layer.input_layernorm(target.embed_tokens().weight)  # (V, H) what v_proj reads per token
            u = x[cfg.mask_token_id] / x[cfg.mask_token_id].norm()
            project = torch.eye(cfg.hidden_size) - torch.outer(u, u)
            layer.self_attn.v_proj.weight.copy_(project)
            rows = target.lm_head().weight  # (V, H)
            layer.self_attn.o_proj.weight.copy_(torch.linalg.lstsq(x @ project, rows).solution.T * 1e4)
    if vh:  # a head whose probabilities differ across slots and rounds
        with torch.no_grad():
            draft.verification_head.weight.normal_(0, 0.3)
    return draft


def olmoe_with_eagle3_drafts(gen: torch.Generator):
    """The engine tests' set-up: the tiny OLMoE (seed 2) loaded on CPU, a random and a rigged EAGLE-3 draft for it
    (:func:`make_eagle3_draft`) and three prompts of 5, 11 and 17 random ids drawn from ``gen``.

    Returns (model, target, {"random": ..., "rigged": ...}, prompts); the caller closes the target.
    """
    model = tiny_model("olmoe", seed=2)
    target = load_target(model, device="cpu")
    drafts = {
        "random": make_eagle3_draft(model, target, rigged=False),
        "rigged": make_eagle3_draft(model, target, rigged=True),
    }
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    return model, target, drafts, prompts


# ---- brute-force reference of expert budgeting, one token at a time --------------------------------------------------

def router_io(target):
    """Record, for every MoE router, its input and the (possibly budgeted) output the experts received."""
    records: dict[int, dict] = {}
    handles = []
    for ordinal, (_, router, _) in enumerate(target.routing.moe_layers):
        def pre(module, args, ordinal=ordinal):
            records.setdefault(ordinal, {})["input"] = args[0].detach().clone()

        def post(module, args, output, ordinal=ordinal):
            records[ordinal]["output"] = tuple(o.detach().clone() for o in output)

        handles.append(router.register_forward_pre_hook(pre))
        handles.append(router.register_forward_hook(post))  # registered after vat's hook: sees its result
    return records, handles


def _scores(family, logits_row):
    if family == "deepseek_v3":
        return [1 / (1 + math.exp(-x)) for x in logits_row]
    m = max(logits_row)
    ex = [math.exp(x - m) for x in logits_row]
    return [e / sum(ex) for e in ex]


def _reference_select(family, router, logits_row, allowed):
    """The family's rule for one token, by hand: returns {expert: weight} (sentinel slots omitted)."""
    k = router.top_k
    if family == "gpt_oss":
        chosen = sorted(allowed, key=lambda e: -logits_row[e])[:k]
        m = max(logits_row[e] for e in chosen)
        ex = {e: math.exp(logits_row[e] - m) for e in chosen}
        return {e: v / sum(ex.values()) for e, v in ex.items()}
    if family == "deepseek_v3":
        return _reference_deepseek(router, logits_row, allowed)
    probs = _scores(family, logits_row)
    chosen = sorted(allowed, key=lambda e: -probs[e])[:k]
    w = {e: probs[e] for e in chosen}
    if family == "mixtral" or getattr(router, "norm_topk_prob", False):
        total = sum(w.values())
        w = {e: v / total for e, v in w.items()}
    return w


def _reference_deepseek(router, logits_row, allowed):
    """DeepSeek-V3 over an allowed set, by hand: groups scored by their top-2 allowed biased scores, the topk_group
    best taken and widened in rank order while they hold fewer than k allowed experts, top-k inside them."""
    k, size = router.top_k, router.num_experts // router.num_group
    scores = _scores("deepseek_v3", logits_row)
    bias = router.e_score_correction_bias.tolist()
    choice = {e: scores[e] + bias[e] for e in allowed}
    members = {g: [e for e in allowed if e // size == g] for g in range(router.num_group)}
    group_score = {g: sum(sorted((choice[e] for e in m), reverse=True)[:2]) for g, m in members.items() if m}
    ranked = sorted(group_score, key=lambda g: -group_score[g])  # stable: ties keep the lower group first
    chosen_groups, held = [], 0
    for rank, g in enumerate(ranked):
        if rank < router.topk_group or held < k:
            chosen_groups.append(g)
            held += len(members[g])
    cands = [e for g in chosen_groups for e in members[g]]
    chosen = sorted(cands, key=lambda e: -choice[e])[:k]
    w = {e: scores[e] for e in chosen}
    if router.norm_topk_prob:
        total = sum(w.values()) + 1e-20
        w = {e: v / total for e, v in w.items()}
    return {e: v * router.routed_scaling_factor for e, v in w.items()}


def reference_budget(family, router, logits, natural_w, natural_ids, groups, budget, policy, rank="weights"):
    """The budgeted routing of one layer by brute force: per-window budget set and per-token rerouting, with Python
    loops; one {expert: weight} dict per token. ``rank="routing"``: DeepSeek-V3's set summed over sigmoid + bias."""
    n_tokens = logits.shape[0]
    logits_l, nat_ids, nat_w = logits.tolist(), natural_ids.tolist(), natural_w.tolist()
    result = []
    windows = {}
    for t in range(n_tokens):
        windows.setdefault(groups[t], []).append(t)
    allowed_of = {}
    for g, tokens in windows.items():
        union = {e for t in tokens for e in nat_ids[t]}
        if len(union) <= budget:
            allowed_of[g] = union
            continue
        mass = [0.0] * router.num_experts
        bias = router.e_score_correction_bias.tolist() if rank == "routing" and family == "deepseek_v3" else None
        for t in tokens:
            for e, s in enumerate(_scores(family, logits_l[t])):
                mass[e] += s + (bias[e] if bias else 0.0)
        allowed_of[g] = set(sorted(range(router.num_experts), key=lambda e: -mass[e])[:budget])
    for t in range(n_tokens):
        allowed = allowed_of[groups[t]]
        natural = dict(zip(nat_ids[t], nat_w[t]))
        if set(natural) <= allowed:
            result.append(natural)
        elif policy == "substitute":
            result.append(_reference_select(family, router, logits_l[t], allowed))
        elif policy == "truncate":  # MoE-Spec: out-of-set experts get zero weight; nothing rescaled or substituted
            result.append({e: w for e, w in natural.items() if e in allowed})
        else:  # truncate_cover
            kept = {e: w for e, w in natural.items() if e in allowed}
            if not kept:  # no natural expert in S: substituted, never left without expert output
                result.append(_reference_select(family, router, logits_l[t], allowed))
                continue
            scale = sum(natural.values()) / sum(kept.values())
            result.append({e: w * scale for e, w in kept.items()})
    return result


# ---- chi-square goodness of fit --------------------------------------------------------------------------------------

def chi_square_critical(df: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square(df) at the normal quantile z (Wilson-Hilferty; z = 3.29 -> p ~ 5e-4)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square(
    counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0, *, zero_cells_empty: bool = True
) -> tuple[float, int]:
    """Pearson statistic of observed counts against probabilities (cells with small expectation pooled) and its
    degrees of freedom; with ``zero_cells_empty`` it also asserts that no zero-probability outcome was counted."""
    n = float(counts.sum())
    expected = probs.double().flatten() * n
    observed = counts.double().flatten()
    order = torch.argsort(expected, descending=True)
    big = order[expected[order] >= min_expected]
    small = order[expected[order] < min_expected]
    obs = torch.cat([observed[big], observed[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    keep = exp > 0
    if zero_cells_empty:
        assert float(observed[expected == 0].sum()) == 0, "a zero-probability outcome was produced"
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


# ---- `vat train` runs on the train_workspace fixture -----------------------------------------------------------------

def train_overrides(ws, out, *extra):
    """`vat train` overrides for a 6-step run on the ``train_workspace`` fixture's target and data, into ``out``."""
    return [
        f"target.path={ws['target']}", f"data.train={ws['data']}", f"output_dir={out}", "data.tokens_per_batch=512",
        "data.max_batch_size=4", "data.max_length=160", "drafter.draft_vocab_size=256", "train.max_steps=6",
        "train.save_every=3", "train.lr=1e-3", "logging.progress=false", *extra,
    ]


def train_config(ws, out, *extra):
    """The loaded config of :func:`train_overrides`."""
    return load_config(None, train_overrides(ws, out, *extra))


def read_metrics(out):
    """The records of a run's metrics.jsonl."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---- small tokenizers and chat templates of the data-prep tests (built in-test, no download) -------------------------

_SPECIAL = [
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today? I am a helpful assistant.",
    "Write a Python function that adds two numbers: def add(a, b): return a + b",
    "user assistant system think The capital of France is Paris.",
    "Speculative decoding drafts tokens and the target verifies them in one forward pass.",
]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Qwen3's template (tools removed): history assistant turns are plain, turns after the last user query get a
# <think> block, so rendering is not prefix-stable turn by turn.
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in message.content %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
            {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""


def build_tokenizer(chat_template: str = CHATML, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE (every string encodes) trained on a few sentences, with chat special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>" if "im_end" in chat_template else "<|eot_id|>",
        pad_token="<|pad|>",
        additional_special_tokens=[t for t in _SPECIAL if t not in ("<|pad|>",)],
    )
    fast.chat_template = chat_template
    return fast


def build_small_tokenizer(vocab_size: int = 100) -> PreTrainedTokenizerFast:
    """A ChatML tokenizer small enough for the tiny test models (vocab 128): pad=0, <|im_end|>=1 (their EOS)."""
    special = ["<|pad|>", "<|im_end|>", "<|im_start|>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    tok.train_from_iterator(_CORPUS + ["user\nassistant\nsystem\n"], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML
    return fast


# ---- memory: peak bytes of live CPU tensors ---------------------------------------------------------------------------


class PeakTensorBytes(TorchDispatchMode):
    """Within ``with PeakTensorBytes() as m:``, ``m.peak`` is the most bytes held at once by CPU tensor storages
    created inside the block (autograd's saved tensors and backward buffers included; storages made before the block,
    such as inputs, and views of them are not counted). Each op's outputs are registered by storage; a storage leaves the count once no
    tensor holds it (checked after every op), so the figure is a peak, not a sum of allocations."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= nbytes
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.data_ptr() in inputs:
                    continue  # a view or an in-place result: nothing allocated
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.live and storage.nbytes() > 0:
                    self.live[ref.cdata] = (ref, storage.nbytes())
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
        return out


def write_reversed_chats(path, rows: int, question_chars: int = 200, answer_chars: int = 160) -> str:
    """A chat file of the packaged Spec-Bench questions' first ``rows``, each answered by its words reversed (cut to
    ``question_chars`` / ``answer_chars``): a small, deterministic training set for a tiny target."""
    from vat.eval.benchmarks import SPEC_BENCH_FILE

    out = []
    with open(SPEC_BENCH_FILE) as f:
        for i, line in enumerate(f):
            if i >= rows:
                break
            q = json.loads(line)["turns"][0][:question_chars]
            answer = " ".join(reversed(q.split()))[:answer_chars]
            out.append({"id": str(i), "conversations": [{"from": "human", "value": q},
                                                        {"from": "gpt", "value": answer}]})
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in out))
    return str(path)
