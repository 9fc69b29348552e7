"""Calibration of the drafters' top-1 probability (and VAT's VH) against greedy acceptance, chain K=7, 10 Spec-Bench prompts."""
import torch
import vat.eval.engine as E
from vat.eval.run import _load_drafts, _load_target, _attach, _load_tokenizer
from vat.eval.ngram import NgramSpec
from vat.eval.benchmarks import load_benchmark
from vat.eval.prompts import render_chat
torch.set_num_threads(1)
for path in ["runs/bench-tiny/cells/eagle3_more/seed0/train/final", "runs/bench-tiny/cells/vat_more/seed0/train/final"]:
    entries = _load_drafts([path], NgramSpec())
    target = _load_target(None, entries, "auto", "cpu")
    _attach(entries, target, None)
    tok = _load_tokenizer(None, target)
    target.aux_layer_ids = list(entries[0].aux_layer_ids)
    rec = []
    orig = E.SpeculativeEngine._chain_round
    def spy(self, cache, draft, root, gen, _o=orig):
        out = _o(self, cache, draft, root, gen)
        rec.append((draft.probs, draft.vh, out.stats.accepted))
        return out
    E.SpeculativeEngine._chain_round = spy
    eng = E.SpeculativeEngine(target, entries[0].model, steps=7, max_new_tokens=64)
    for p in load_benchmark("spec_bench", limit=13)[:10]:
        eng.generate(render_chat(tok, [{"role": "user", "content": p.turns[0]}]))
    E.SpeculativeEngine._chain_round = orig
    q1 = [pr[0] for pr, _, a in rec]; acc1 = [a >= 1 for _, _, a in rec]
    reached = [(pr[k], (vh[k] if vh else None), a > k) for pr, vh, a in rec for k in range(len(pr)) if a >= k]
    mq = sum(r[0] for r in reached) / len(reached); ma = sum(r[2] for r in reached) / len(reached)
    line = f"{path}: rounds {len(rec)}, reached positions {len(reached)}: mean draft q(d) {mq:.3f}, accepted {ma:.3f}"
    if reached[0][1] is not None:
        line += f", mean VH {sum(r[1] for r in reached) / len(reached):.3f}"
    print(line)
    # survival: path probability Π q vs the empirical survival to position k
    for k in (1, 3, 5):
        pp = [torch.tensor(pr[:k]).prod().item() for pr, _, a in rec if len(pr) >= k]
        surv = [a >= k for pr, _, a in rec if len(pr) >= k]
        print(f"  position {k}: mean path prob {sum(pp)/len(pp):.3f}, survival {sum(surv)/len(surv):.3f}")
