"""The `vat` command line: a thin argparse layer that dispatches to each subcommand's `main`.

Every subcommand's implementation lives in its own module and is imported only when that subcommand runs,
so `vat --help` is fast and a broken optional dependency only breaks the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vat.config import DEFAULT_BUDGET_POLICY, TRAINING_BUDGET_POLICIES
from vat.errors import VatError

BENCHMARK_HELP = "Spec-Bench/MT-Bench question file (FastChat jsonl), a known name (spec_bench, mt_bench, humaneval, gsm8k, alpaca) or a datasets hub name"


def _capture(args: argparse.Namespace):
    """`vat prep capture`: ``--data tiny`` / ``tiny-regen`` / ``tiny-regen-t1`` resolve (and build once) as a recipe's
    ``data.train`` does, at ``--max-length`` (else the recipes' default), so a capture reads the rows a run trains on."""
    from vat.config import DataConfig
    from vat.train.defaults import TINY_DATA_NAMES, resolve_train_data

    if args.data in TINY_DATA_NAMES:
        args.data = resolve_train_data(args.data, args.target, args.max_length or DataConfig.max_length)
    return _dispatch("vat.data_prep.capture:main")(args)


def _dispatch(target: str):
    """Return a handler that imports ``module:function`` lazily and calls it with the parsed args."""

    def run(args: argparse.Namespace):
        module_name, func_name = target.split(":")
        return getattr(importlib.import_module(module_name), func_name)(args)

    return run


def _add_prep(sub: argparse._SubParsersAction) -> None:
    prep = sub.add_parser(
        "prep",
        help="prepare data: chats -> token ids + loss masks, regenerate, draft vocab, expert affinity, tiny target",
        description="Data preparation. Each step writes its outputs and a stats.json; bad rows are skipped and counted.",
    )
    steps = prep.add_subparsers(dest="prep_command", metavar="STEP", required=True)

    p = steps.add_parser("chat", help="tokenize chats (ShareGPT / messages / UltraChat) with assistant-only loss masks")
    p.add_argument("--input", required=True, help="JSON array or JSON Lines file, or a datasets hub name")
    p.add_argument("--tokenizer", required=True, help="tokenizer path (the target's); its chat template is used")
    p.add_argument("--output", required=True, help="output directory (datasets save_to_disk + stats.json)")
    p.add_argument("--format", default="auto", choices=["auto", "sharegpt", "messages"], help="input layout")
    p.add_argument("--max-length", type=int, default=2048, help="drop conversations longer than this many tokens")
    p.add_argument("--num-proc", type=int, default=1, help="processes for datasets.map")
    p.add_argument("--limit", type=int, default=None, help="read at most this many rows")
    p.set_defaults(func=_dispatch("vat.data_prep.chat:main"))

    p = steps.add_parser("regen", help="regenerate assistant turns with the target (drafts trained on its own outputs)")
    p.add_argument("--target", required=True, help="target model path")
    p.add_argument("--input", required=True, help="chat file (JSON array or JSON Lines)")
    p.add_argument("--output", required=True, help="output .jsonl; appended to, ids already written are skipped")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn; a reply cut here is marked truncated")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--batch-size", type=int, default=64, help="rows per decode batch (prompts bucketed by length)")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="a conversation ends before the first turn whose prompt is longer (default: context - max new tokens)",
    )
    p.add_argument("--max-turns", type=int, default=None, help="regenerate only the first K assistant turns")
    p.add_argument("--pool-size", type=int, default=None, help="conversations bucketed together (default 4 x batch)")
    p.add_argument("--limit", type=int, default=None, help="consider only the first N input rows")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on CPU: fastest, see docs)")
    p.set_defaults(func=_dispatch("vat.data_prep.regen:main"))

    p = steps.add_parser("vocab", help="draft vocabulary: the N most frequent loss-masked target tokens (d2t/t2d)")
    p.add_argument("--data", required=True, help="prepared dataset directory (from `vat prep chat`)")
    p.add_argument("--size", type=int, default=32000, help="draft vocabulary size")
    p.add_argument("--output", required=True, help="output .safetensors with d2t and t2d")
    p.add_argument("--vocab-size", type=int, default=None, help="target vocab size V (default: from the tokenizer's dir)")
    p.set_defaults(func=_dispatch("vat.data_prep.vocab:main"))

    p = steps.add_parser("affinity", help="token -> expert affinity table from the target's captured routing")
    p.add_argument("--target", required=True, help="target model path")
    p.add_argument("--data", required=True, help="prepared dataset directory")
    p.add_argument("--output", required=True, help="output .safetensors")
    p.add_argument("--layers", type=int, nargs="*", default=None, help="MoE layer indices (default: all)")
    p.add_argument("--vocab", default=None, help="draft vocab file: rows are indexed by draft id when given")
    p.add_argument("--limit", type=int, default=None, help="use at most this many rows")
    p.add_argument("--batch-size", type=int, default=8)
    p.set_defaults(func=_dispatch("vat.data_prep.affinity:main"))

    p = steps.add_parser("expert-probe", help="EcoSpec's context-aware expert predictor: a probe on an EAGLE-3 draft's "
                         "states, fitted to the target's routing over a prepared dataset (held-out rows measure it "
                         "against the affinity table)")
    p.add_argument("--draft", required=True, help="EAGLE-3 draft directory (its affinity.safetensors is the prior)")
    p.add_argument("--data", required=True, help="prepared dataset directory (e.g. the draft's training data)")
    p.add_argument("--output", required=True, help="output .safetensors (`vat eval --affinity` reads it)")
    p.add_argument("--target", default=None, help="target model path (default: the one the draft records)")
    p.add_argument("--affinity", default=None, help="the prior table (default: the draft's affinity.safetensors)")
    p.add_argument("--limit", type=int, default=256, help="rows of the dataset to capture (default 256)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per row (default 512)")
    p.add_argument("--steps", type=int, default=6, help="draft steps per anchor: the tree depths served (default 6)")
    p.add_argument("--holdout", type=float, default=0.2, help="share of the rows held out to measure the probe")
    p.add_argument("--epochs", type=int, default=40, help="passes over the fitting pairs (default 40)")
    p.set_defaults(func=_dispatch("vat.eval.expert_probe:main"))

    p = steps.add_parser("capture", help="run the target once over a prepared dataset and store its features "
                         "(aux + last hidden states, routing) for `data.capture` training")
    p.add_argument("--target", required=True, help="target model path (or tiny / tiny-quick)")
    p.add_argument("--data", required=True, help="prepared dataset directory (from `vat prep chat`), or tiny / "
                   "tiny-regen / tiny-regen-t1: the embedded target's data, as data.train names it")
    p.add_argument("--output", required=True, help="capture directory; a rerun continues after its last complete shard")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", default=None,
                   help="0-indexed layer outputs the draft reads (default EAGLE-3's [1, L//2-1, L-4])")
    p.add_argument("--dtype", default="auto", help="target (and stored feature) dtype: auto, float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="target device (default cuda if available, else cpu)")
    p.add_argument("--device-map", default=None, help="e.g. auto: shard a large target over the node's GPUs")
    p.add_argument("--experts-impl", default="grouped_mm", choices=["eager", "grouped_mm", "batched_mm", "triton"])
    p.add_argument("--tokens-per-batch", type=int, default=8192, help="padded tokens per target forward")
    p.add_argument("--max-batch-size", type=int, default=16, help="rows per target forward")
    p.add_argument("--shard-tokens", type=int, default=1 << 17,
                   help="tokens per shard file: held in host memory until written, the unit of resume")
    p.add_argument("--limit", type=int, default=None, help="capture only the first N rows")
    p.add_argument("--max-length", type=int, default=None, help="skip rows longer than this many tokens")
    p.add_argument("--part", default="0/1", help="I/N: write only shards I, I+N, ... (N processes fill one capture, "
                   "e.g. one per node; complete once every part ran)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_capture)

    p = steps.add_parser("tiny-target", help="build the embedded tiny MoE target (tokenizer + OLMoE model) on ShareGPT")
    p.add_argument("--size", default="full", choices=["full", "quick", "bench"],
                   help="full: the default tiny target (16 experts top-4, ~12-24 min); quick: much smaller, for tests "
                   "and the demo (~1.5 min); bench: 64 experts top-8 on chat and Python code, the target the "
                   "evidence runs on (hours; resumes after a kill)")
    p.add_argument("--output", default=None, help="output directory (default: $VAT_HOME/tiny-target[-SIZE])")
    p.add_argument("--quick", action="store_true", help="the same as --size quick")
    p.add_argument("--smoke", action="store_true", help="the size's architecture trained on a sliver of text, in "
                   "seconds: checks the build end to end (not a usable target)")
    p.add_argument("--quality", action="store_true", help="also write the target-quality table (quality.json/.md "
                   "in the output; always for --size bench)")
    p.add_argument("--seed", type=int, default=None,
                   help="initialisation and data-order seed (default: $VAT_TINY_SEED, else 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    p.set_defaults(func=_dispatch("vat.prep:tiny_target_main"))


def _add_target_options(p: argparse.ArgumentParser) -> None:
    """How to load the target: the trainer's ``target.*`` keys (:class:`vat.config.TargetConfig`, same defaults and
    choices) as flags, passed to the same loader (:func:`vat.target.load_target`)."""
    from vat.config import CHOICES, TargetConfig

    defaults = TargetConfig()
    g = p.add_argument_group("target loading (the trainer's target.* keys)")
    g.add_argument("--experts-impl", default=defaults.experts_impl, choices=CHOICES["target.experts_impl"],
                   help="experts forward of every MoE layer: grouped_mm (transformers), eager, triton (vat's "
                   f"budget-aware kernel; skips the experts a budget drops) (default {defaults.experts_impl})")
    g.add_argument("--dtype", default=defaults.dtype, help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | "
                   f"float16 (default {defaults.dtype})")
    g.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1 (default: CUDA if available, else CPU)")
    g.add_argument("--device-map", default=defaults.device_map, help="e.g. `auto` to shard a large target across "
                   "the GPUs of a node (overrides --device)")


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure a target's expert scattering per verification window and what a budget costs",
        description="Runs the target over benchmark prompts; writes DIR/profile.json (union per window and layer, "
        "expert bytes per window, KL of the budgeted next-token distribution to the unbudgeted one).",
    )
    p.add_argument("--target", required=True, help="target model path (or `tiny` for the embedded default)")
    p.add_argument("--benchmark", default=None, help=BENCHMARK_HELP + " (required unless --perplexity-grid)")
    p.add_argument("--window", type=int, default=8, help="window length W (the verification block, K+1)")
    p.add_argument("--budget", default=None, help="expert budget B per layer (int, or comma list per MoE layer)")
    p.add_argument("--policy", default=DEFAULT_BUDGET_POLICY, choices=TRAINING_BUDGET_POLICIES)
    p.add_argument("--limit", type=int, default=None, help="use at most this many prompts")
    p.add_argument("--max-length", type=int, default=512, help="truncate prompts to this many tokens")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--verify-widths", default=None, help="also write EVICT's verification-cost profile "
                   "(profile.json `verify_cost`): expert union, modeled and measured time of verifying w tokens of "
                   "the target's own answers, for each w of this comma list, e.g. 1,2,4,8,16,32,64")
    p.add_argument("--new-tokens", type=int, default=None, help="--verify-widths: tokens of the target's greedy "
                   "answer per prompt (default 64); --quality: the answers' token cap (default 96)")
    p.add_argument("--cost-model", default="h200", help="--verify-widths: accelerator of the modeled times "
                   "(h100 | h200 | a100 | l40s; default h200)")
    p.add_argument("--quality", action="store_true", help="write DIR/quality.json and .md instead: the "
                   "target-quality table per benchmark (share of distinct 32-token greedy answers, distinct-4-gram "
                   "ratio, turns ended, code answers, natural expert union per --window tokens) and one answer each; "
                   "--benchmark defaults to spec_bench and humaneval, --limit to 40, --new-tokens to 96")
    g = p.add_argument_group("perplexity grid (Window Pool, docs/window_pool.md): held-out perplexity of targets side by side "
                             "under W x d_w window-sharing constraints and hard budgets B")
    g.add_argument("--perplexity-grid", action="store_true", help="write DIR/perplexity_grid.json and .md instead "
                   "of the scattering profile")
    g.add_argument("--compare-target", action="append", default=None, metavar="LABEL=PATH",
                   help="another target measured beside --target (labelled base); repeatable")
    g.add_argument("--data", default="tiny-heldout", help="held-out text: tiny-heldout (the tiny build's held-out "
                   "conversations) or a prepared dataset dir (default tiny-heldout)")
    g.add_argument("--windows", default="4,8,16,32", help="grid window lengths W (default 4,8,16,32)")
    g.add_argument("--pools", default="4,6,8", help="grid experts per window d_w (default 4,6,8)")
    g.add_argument("--budgets", default="4,8", help="hard budgets B at W = --verify-window (default 4,8)")
    g.add_argument("--verify-window", type=int, default=8, help="the verification block K + 1 (default 8)")
    g.add_argument("--batch-size", type=int, default=8, help="held-out sequences per forward (default 8)")
    _add_target_options(p)
    p.set_defaults(func=_dispatch("vat.profile:main"))


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a draft (EAGLE-3 / DFlash, baseline or VAT) from a YAML recipe",
        description="vat train RECIPE.yaml [key.sub=value ...]. Overrides use dotted keys, e.g. train.max_steps=20 "
        "output_dir=runs/x budget.B=8 resume=auto. Unknown keys stop at once with the closest valid key.",
    )
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny/eagle3_vat.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides key.sub=value")
    p.set_defaults(func=_dispatch("vat.train.trainer:cli_main"))


class _PolicyFlag(argparse.Action):
    """A `vat eval` policy flag (``--tree-policy``, ``--policy``): stores its value (EvalConfig checks it) and lists
    the choices of the policy registry (vat.eval.policies.registry) in its help, read only when the help is printed:
    the registry imports torch, which `vat --help` and the other commands do not need."""

    def __init__(self, option_strings, dest, setting: str, help: str, **kwargs):
        self.setting = setting
        self.template = help  # {choices}, {registered}: filled from the registry
        super().__init__(option_strings, dest, **kwargs)

    @property
    def help(self) -> str:
        """The help text with the registry's choices."""
        from vat.eval.policies.registry import policy_help  # the command's module, as _dispatch imports it

        names, registered = policy_help(self.setting)
        return self.template.format(choices=", ".join(names), registered=registered)

    @help.setter
    def help(self, value) -> None:  # argparse.Action.__init__ assigns help: the template stands
        pass

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="real speculative decoding: acceptance length per benchmark, with and without expert budgets",
        description="Runs chain / tree / block speculative decoding on the target with a KV cache and writes "
        "DIR/eval.json, DIR/generations.jsonl, DIR/report.md and PNG plots. `--draft ngram` is training-free prompt "
        "lookup (vLLM's ngram rule), `--draft suffix` suffix decoding (vLLM's method: suffix), in the same engine; "
        "the autoregressive baseline always runs. Every setting's default: vat.eval.config.EvalConfig "
        "(docs/eval.md).",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--target", default=None, help="target path, or `tiny` (default: the one the draft was trained for; "
                   "required when no trained draft is given)")
    p.add_argument("--draft", action="append", default=None, help="draft dir (vat final/, SGLang or speculators "
                   "export, DFlash draft), a free draft (`ngram`, `ngram-{vllm|recent}-MIN-MAX`, `suffix`, `suffix-dDEPTH`, "
                   "`suffix-local`) or `none`; repeatable")
    # the settings' flags: unset ones are absent from args and take vat.eval.config.EvalConfig's default, and its
    # checks reject a bad choice in one line (defaults and choices are stated there only)
    p.add_argument("--benchmark", action="append", help=BENCHMARK_HELP + "; repeatable (default spec_bench)")
    p.add_argument("--steps", type=int, help="chain length K (a DFlash draft drafts block_size - 1 per round)")
    p.add_argument("--tree", help="dynamic tree as top_k,depth,total_tokens (e.g. 8,6,48)")
    p.add_argument("--temperature", type=float, help="0 = greedy; > 0 = lossless speculative sampling")
    p.add_argument("--budget", help="comma list of budgets, `none` = natural routing: none,8,4; `auto` = "
                   "AcceptMoE's self-sized set (default: none; auto with --policy acceptmoe)")
    p.add_argument("--policy", action=_PolicyFlag, setting="policy", help="budget policy, one of {choices}: substitute "
                   "/ truncate = MoE-Spec (top-B experts by summed router score; truncate gives out-of-set experts zero "
                   "weight, as the paper; truncate_cover rescales and substitutes tokens left without experts); "
                   "{registered}")
    p.add_argument("--budget-rank", action=_PolicyFlag, setting="budget_rank", help="which scores rank each budget "
                   "set, one of {choices} (default weights: the scores that weigh the experts, MoE-Spec's sum); "
                   "{registered}")
    p.add_argument("--commitment", help="AcceptMoE's p̂_d (probability that depth d is on the accepted path): an "
                   "eval.json of the same draft (its acceptance by position at budget none) or a JSON list [p_1, p_2, "
                   "...]; default the prior 0.8^d")
    p.add_argument("--acceptmoe-residency", type=int, help="AcceptMoE under expert offloading (its Eq. 6): prune each "
                   "verification set of its least-demanded non-resident experts against a live cache of C resident "
                   "experts per layer (--offload-policy); C must be one of --offload's sizes, which prices it")
    p.add_argument("--vh-threshold", type=float, help="stop drafting (truncate a DFlash block) when the "
                   "verification head predicts rejection")
    p.add_argument("--draft-confidence", type=float, help="stop an EAGLE-3 chain after a drafted token the draft gives "
                   "less than this probability; the token is verified (transformers' assistant_confidence_threshold)")
    p.add_argument("--tree-policy", action=_PolicyFlag, setting="tree_policy", help="which drafted tokens are verified, "
                   "one of {choices}: {registered}")
    p.add_argument("--ecospec-lambda", type=float, help="EcoSpec's trade-off: nats of draft log-probability one "
                   "predicted new expert per layer costs; 0 = confidence selection")
    p.add_argument("--affinity", help="EcoSpec's expert predictor: an affinity table (`vat prep affinity --target ...` "
                   "output, or a draft's affinity.safetensors); default each draft's own")
    p.add_argument("--verify-cost", help="EVICT's verification-cost profile (profile.json of `vat profile "
                   "--verify-widths`); default: profiled on the fly per draft and benchmark, on the draft's own "
                   "blocks in the calibration pass (the dev split's first prompts when the benchmark is a @test "
                   "split, else its own first prompts; the target's greedy text with --evict-calibration 0)")
    p.add_argument("--evict-calibration", type=int, help="EVICT: prompts of the calibration pass that maps each node's "
                   "raw estimate to the acceptance rate observed at its depth and confidence, per draft and benchmark, "
                   "on the dev split of a @test benchmark (default 8; 0 = the raw estimates)")
    p.add_argument("--cost-model", help="roofline bytes model: h100 | h200 | a100 | l40s (data-sheet HBM bandwidth "
                   "and bf16 FLOPs), optionally with an achievable-bandwidth factor and a fixed latency per forward, "
                   "h200@eta=0.8,latency_us=10 (a bare knob takes its documented default); adds modeled tokens/s and "
                   "speed-up over AR to eval.json and the report")
    p.add_argument("--served-dtype", help="dtype the cost model prices weights and KV in (bfloat16 | float16 | float32 "
                   "| fp8, whatever dtype the eval runs in)")
    p.add_argument("--offload", help="expert offloading model: resident experts per MoE layer, a comma list (e.g. "
                   "8,12), each a modeled GPU cache with the rest in host memory; adds H2D bytes per token, hit rate "
                   "and modeled speed-up under offload for every decode (needs --cost-model)")
    p.add_argument("--offload-policy", help="which resident expert a load evicts: lru | lfu (default lru)")
    p.add_argument("--offload-link", help="host-to-device link: pcie5 (PCIe 5.0 x16, 64 GB/s per direction) | c2c "
                   "(GH200 NVLink-C2C, 450 GB/s per direction); default pcie5")
    p.add_argument("--ngram-n", type=int, help="ngram draft: longest suffix matched, as vLLM's prompt_lookup_max")
    p.add_argument("--ngram-min", type=int, help="ngram draft: shortest suffix matched, as vLLM's prompt_lookup_min")
    p.add_argument("--ngram-rule", help="ngram draft: copy after the earliest occurrence of the matched suffix "
                   "(vllm, as vLLM's proposer) or the latest (recent)")
    p.add_argument("--max-new-tokens", type=int, help="tokens generated per turn")
    p.add_argument("--limit", type=int, help="prompts per benchmark")
    p.add_argument("--reference-cache", help="directory that keeps the natural greedy decode of each benchmark "
                   "between evals: budgeted runs read it instead of an extra AR pass (greedy only)")
    p.add_argument("--reference-target", help="quality figures (agreement, stepwise agreement, KL) against this "
                   "target's natural greedy output and distribution, for every pass, natural routing included (e.g. "
                   "the base a Window Pool target was trained from); same tokenizer; default: the target's own")
    p.add_argument("--batch-size", type=int, help="only 1 (prompts are decoded one at a time)")
    p.add_argument("--seed", type=int, help="seeds every sampled prompt / turn")
    p.add_argument("--output", required=True, help="output directory")
    _add_target_options(p)
    p.set_defaults(func=_dispatch("vat.eval.run:main"))


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="seeds x methods: train every draft, evaluate it for real, τ per benchmark with 95 %% intervals",
        description="vat bench CONFIG.yaml [key.sub=value ...]. Trains each method with each seed on the same data, "
        "order and steps, evaluates every draft (and the training-free baselines) with the real engine on the same "
        "prompts, and writes DIR/bench.json, DIR/bench.md and PNGs: τ per benchmark with bootstrap intervals over "
        "seeds and prompts, paired ratios to the reference method, τ against training tokens. Finished cells are "
        "skipped on rerun and a killed training resumes. Overrides use dotted keys, e.g. seeds=[0] eval.limit=20 "
        "output_dir=runs/b methods.vat.overrides=[loss.vh_weight=0].",
    )
    p.add_argument("config", help="bench YAML, e.g. recipes/bench/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides key.sub=value")
    p.add_argument("--render", action="store_true", help="run nothing: rebuild bench.json, bench.md and the PNGs "
                   "from the cells already finished (e.g. a committed bench under the current statistics)")
    p.add_argument("--methods", default=None, metavar="A,B", help="run only these methods' (and baselines') cells, "
                   "e.g. to shard a bench by method; the tables still cover every finished cell")
    p.add_argument("--train-only", action="store_true", help="train (or resume) the drafts and evaluate nothing, "
                   "e.g. to train on GPUs and evaluate elsewhere; a later run without it reuses them and evaluates")
    p.add_argument("--record", default=None, metavar="DIR", help="run nothing: write the bench's record to DIR "
                   "(summary, and per cell its record and per-prompt counts; no drafts or checkpoints), small "
                   "enough to commit; `vat bench DIR/bench_config.yaml output_dir=DIR --render` renders it again")
    p.set_defaults(func=_dispatch("vat.bench.run:main"))


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained draft for SGLang or vLLM (speculators; DFlash drafts in the DFlash release layout)",
        description="Converts a vat checkpoint to an engine's layout; the aux-layer convention is written explicitly. "
        "EAGLE-3 drafts: --format sglang or speculators; DFlash drafts: --format dflash.",
    )
    p.add_argument("checkpoint", help="vat checkpoint directory (output_dir/final or checkpoints/step_N)")
    p.add_argument("--format", required=True, choices=["sglang", "speculators", "dflash"])
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--target", default=None,
                   help="target directory or `tiny` whose input embedding a speculators export ships "
                        "(default: the draft's recorded target_path)")
    p.set_defaults(func=_dispatch("vat.export.cli:main"))


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole pipeline on the embedded tiny MoE target: build, prep, train EAGLE-3 vs VAT, eval, report",
        description="Builds (or reuses) the tiny target, prepares ShareGPT data, trains the baseline and VAT drafts, "
        "evaluates them on Spec-Bench and HumanEval with and without expert budgets, and writes DIR/report.md.",
    )
    p.add_argument("--quick", action="store_true",
                   help="a smaller run (< 3 min on 2 CPU cores), still real; trains the DFlash + VAT draft too")
    p.add_argument("--dflash", action="store_true",
                   help="full demo: train and evaluate the DFlash block drafter + VAT beside EAGLE-3 (about +6 min)")
    p.add_argument("--output", default="outputs/demo", help="output directory")
    p.set_defaults(func=_dispatch("vat.demo:main"))


def build_parser() -> argparse.ArgumentParser:
    """The full `vat` argument parser (also used to generate the README's CLI reference)."""
    parser = argparse.ArgumentParser(
        prog="vat",
        description="Verification-aware training of speculative-decoding drafts for MoE targets.",
    )
    parser.add_argument("--version", action="version", version="vat " + __import__("vat").__version__)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch's intra-op work (default "
                        "$VAT_THREADS, else torch's: every core). OpenMP waits passively unless OMP_WAIT_POLICY is set, "
                        "so two vat processes on few cores do not spin against each other")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_prep, _add_profile, _add_train, _add_eval, _add_bench, _add_export, _add_demo):
        add(sub)
    return parser


def apply_thread_policy(threads: int | None) -> None:
    """Passive OpenMP waits (set before torch starts its thread pool) and ``threads`` intra-op threads (or
    ``$VAT_THREADS``); a bad value is one error line."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is None and os.environ.get("VAT_THREADS"):
        try:
            threads = int(os.environ["VAT_THREADS"])
        except ValueError:
            raise VatError(f"$VAT_THREADS must be a positive integer, got {os.environ['VAT_THREADS']!r}") from None
    if threads is None:
        return
    if threads < 1:
        raise VatError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def _distributed_group_up() -> bool:
    """Whether a torch.distributed default group exists (without importing torch when nothing has)."""
    if "torch" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _end_group_brought_up(grouped_before: bool, wait: bool) -> None:
    """The command brought a process group up (torchrun / accelerate launch): end it before the process exits. After
    a failure, without the barrier: a peer may never reach it."""
    if grouped_before or not _distributed_group_up():
        return
    from vat.train.distributed import end_process_group

    end_process_group(wait=wait)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vat` console script and `python -m vat`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    grouped_before = _distributed_group_up()
    try:
        apply_thread_policy(args.threads)
        result = args.func(args)
    except VatError as err:
        print(f"vat: error: {err}", file=sys.stderr)
        _end_group_brought_up(grouped_before, wait=False)
        return 2
    except KeyboardInterrupt:
        print("vat: interrupted", file=sys.stderr)
        _end_group_brought_up(grouped_before, wait=False)
        return 130
    _end_group_brought_up(grouped_before, wait=True)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
