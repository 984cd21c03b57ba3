"""What decoding sees on held-out prompts: the engine's tau, TPF and acceptance profile per prompt set and output
length, beside the accepted-run estimate `recguide distill` used to log (docs/distill.md, "Measured acceptance").

    python eval/engine_tau.py --out eval/results/smollm2/engine_tau.json            # the shipped adapter
    python eval/engine_tau.py --adapter runs/ab/first/work/run/final --first-draft verifier --out ...

For each set (held-out chat prompts through the chat template, held-out raw code) and each length (64, 256 new
tokens): the base's HF greedy continuation (the reference every output must equal), LinearSS at B = 4 / 8 / 16 and
RecGuide auto through the folder's `generate` (its value and cost tables: on a CPU the policy mostly takes plain
steps, so its tau says little about the drafter), and the estimates at B = 8 on [prompt | reference]: the one
`recguide distill` used to log (`loop.heldout_taus`: every 4th anchor with a whole 16-block inside the continuation),
the same mean over every anchor of exact 8-blocks, and decoding's own path over those runs (`measure.path_tau`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def measure_set(model, tokenizer, student, prompts, new_tokens: int, blocks, first_draft: str, batch: int) -> dict:
    import recguide_hf
    from recguide_hf.core.masks import left_pad
    from recguide_hf.tools.distill.loop import heldout_taus
    from recguide_hf.tools.distill.measure import anchor_runs, engine_taus, every_anchor_tau, path_tau
    from recguide_hf.tools.distill.teacher import continue_greedily

    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = tokenizer.pad_token_id
    t0 = time.time()
    refs = []
    for i in range(0, len(prompts), batch):  # the reference: HF greedy of the base (LoRA never routed)
        refs += continue_greedily(model, prompts[i:i + batch], new_tokens, pad, eos_ids)
    res = engine_taus(model, prompts, blocks, new_tokens, first_draft, batch, pad, eos_ids, references=refs)
    # RecGuide as a user gets it: the folder's generate, its tables, block size auto
    new = rounds = forwards = 0
    mix: dict[int, int] = {}
    equal = True
    for i in range(0, len(prompts), batch):
        ids, attn = left_pad(prompts[i:i + batch], pad)
        out = recguide_hf.generate(model, input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens,
                                   do_sample=False, recguide_mode="recguide", recguide_block_size="auto",
                                   recguide_first_draft=first_draft, pad_token_id=pad, return_dict_in_generate=True)
        s = out.recguide_stats
        new, rounds, forwards = new + s["new_tokens"], rounds + s["rounds"], forwards + s["request_forwards"]
        for b, c in s["block_sizes"].items():
            mix[int(b)] = mix.get(int(b), 0) + c
        for r, ref in enumerate(refs[i:i + batch]):
            got = out.sequences[r, ids.shape[1]:].tolist()
            equal &= got[:len(ref)] == ref
    res["recguide_auto"] = {"tau": round(new / rounds, 3), "tpf": round(new / forwards, 3), "block_mix": mix,
                            "equal": equal}
    # the estimates, from teacher-forced runs on [prompt | reference] at B = 8
    x = torch.full((len(prompts), max(len(p) + len(c) for p, c in zip(prompts, refs))), pad, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, refs)):
        x[i, :len(p) + len(c)] = torch.tensor(p + c)
    lo = torch.tensor([len(p) for p in prompts])
    valid = lo + torch.tensor([len(c) for c in refs])
    runs = anchor_runs(student, x, lo, valid, 8)
    tokens = rounds = 0
    for r, row in enumerate(runs):
        t, n = path_tau(row, int(lo[r]) - 1, int(valid[r]), 8)
        tokens, rounds = tokens + t, rounds + n
    # the old estimate's anchors: positions lo .. valid - 8 (a whole block inside the continuation)
    spread = [v for r, row in enumerate(runs) for v in row[1:max(1, int(valid[r] - lo[r]) - 7)]]
    res["estimate_B8"] = {"distill_logged": heldout_taus(student, model, x, lo, valid)["tau_B8"],
                          "every_anchor": round(every_anchor_tau(spread, 8), 3),
                          "decoding_path": round(tokens / rounds, 3)}
    res["reference_tokens"] = sum(len(c) for c in refs)
    res["seconds"] = round(time.time() - t0, 1)
    return res


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recguide_hf.models.draft_adapter import attach_draft_adapter
    from recguide_hf.models.known import fetch
    from recguide_hf.tools.distill.loop import AdapterStudent
    from recguide_hf.tools.distill.make import heldout_sets

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a known model's name or a self-speculative folder")
    p.add_argument("--adapter", type=Path, default=None, help="another drafting LoRA on the same folder (a run's "
                                                              "run/final)")
    p.add_argument("--first-draft", choices=["mask", "verifier"], default=None,
                   help="the layout the adapter drafts in (default: the folder's generation config)")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts per set")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    folder = fetch(args.model) if not Path(args.model).exists() else Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    if args.adapter:
        attach_draft_adapter(model, args.adapter)
    first_draft = args.first_draft or getattr(model.generation_config, "recguide_first_draft", "mask")
    student = AdapterStudent.attached(model, first_draft)
    report = {"model": args.model, "adapter": str(args.adapter or "shipped"), "first_draft": first_draft,
              "command": "python eval/engine_tau.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "torch_threads": torch.get_num_threads(), "sets": {}}
    for name, prompts in heldout_sets(tokenizer, args.prompts).items():
        for length in args.lengths:
            res = measure_set(model, tokenizer, student, prompts, length, args.blocks, first_draft, args.batch)
            report["sets"][f"{name}_{length}"] = res
            print(name, length, json.dumps(res), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["equal"] and r["recguide_auto"]["equal"] for r in report["sets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
