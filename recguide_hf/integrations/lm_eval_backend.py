"""`--model recguide`: lm-evaluation-harness's `hf` backend plus RecGuide statistics in the results file.

The stock backend already decodes with RecGuide: `lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`
loads the model folder, whose `custom_generate/generate.py` replaces `model.generate`. This subclass changes two
things, and on CPU a third:

1. It passes `max_new_tokens` (= lm-eval's `max_length` - padded context width). The stock backend passes only
   `max_length`, which a `max_new_tokens` in a folder's generation_config.json would override (the bundled
   folder sets none), so with such a folder `max_gen_toks` would be ignored.
2. It asks `generate` for `return_dict_in_generate=True`, keeps each call's `recguide_stats` and writes their
   pooled summary (TPF, tau, acceptance, hits, block-size mix, generated tokens, seconds in `generate`) into the
   results file under `config.recguide_stats`. Under `accelerate launch` the statistics of all processes are
   gathered (requests that lm-eval duplicates to even out the ranks are counted too).
3. Data parallel on CPU processes: HFLM splits the requests among `accelerate launch` processes only when it
   counts more than one GPU; CPU processes all stay rank 0 of 1 and each evaluates every request. This class
   gives them their real rank and world size (launch with `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu
   --num_processes 2 -m recguide_hf.integrations.lm_eval_backend ...`; `accelerate launch --cpu` starts one
   process only).

lm-eval 0.4.13 has no plugin entry points, so this module must be imported before lm-eval resolves the model
name. Either run the CLI through it:

    python -m recguide_hf.integrations.lm_eval_backend --model recguide \\
        --model_args pretrained=recguide_hf/bundled/recguide-tiny --device cpu \\
        --include_path eval/tasks --tasks recguide_local --gen_kwargs recguide_mode=recguide

or import it before calling the API: `import recguide_hf.integrations.lm_eval_backend;
lm_eval.simple_evaluate(model="recguide", ...)`. `trust_remote_code` defaults to True here (the folder's code
files are shims into this package).
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .. import BUNDLED_MODEL
from ..models.known import resolve

DEFAULT_MODEL = str(BUNDLED_MODEL)
POOLED = ("new_tokens", "forwards", "rounds", "query_tokens", "accepted_drafts", "drafted", "branch_rounds",
          "forwards_saved")


def summarize(per_request: list[dict]) -> dict:
    """Pool per-request `recguide_stats` entries (ratios of sums, as eval/metrics/acceptance computes them)."""
    totals = {key: sum(int(s.get(key, 0)) for s in per_request) for key in POOLED}
    hits, sizes = Counter(), Counter()
    for s in per_request:
        hits.update(s.get("hits", {}))
        sizes.update({int(k): v for k, v in s.get("block_sizes", {}).items()})
    ratio = lambda a, b: a / b if b else 0.0  # noqa: E731
    return {
        "requests": len(per_request), **totals,
        "tpf": ratio(totals["new_tokens"], totals["forwards"]),
        "tau": ratio(totals["new_tokens"], totals["rounds"]),
        "acceptance": ratio(totals["accepted_drafts"], totals["drafted"]),
        "coverage": ratio(sum(hits.values()), totals["branch_rounds"]),
        "hits": dict(sorted(hits.items())),
        "block_sizes": {k: sizes[k] for k in sorted(sizes)},
    }


@register_model("recguide")
class RecGuideLM(HFLM):
    """HFLM for a RecGuide model folder; per-call `recguide_*` settings come in through `--gen_kwargs`."""

    def __init__(self, pretrained=DEFAULT_MODEL, trust_remote_code: bool = True, **kwargs) -> None:
        if isinstance(pretrained, str):  # a known model's name (`pretrained=smollm2`): its folder, made on first use
            pretrained = str(resolve(pretrained))
        super().__init__(pretrained=pretrained, trust_remote_code=trust_remote_code, **kwargs)
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1 and self._world_size == 1 \
                and not kwargs.get("parallelize"):
            # HFLM shards requests across processes only when it counts more than one GPU (or NPU/XPU/HPU);
            # `accelerate launch` CPU processes all stay rank 0 of 1 and each runs every request. Shard them.
            self._rank, self._world_size = accelerator.process_index, accelerator.num_processes
        self.recguide_requests: list[dict] = []  # per-request stats of RecGuide-decoded requests
        self.recguide_calls: list[dict] = []  # one entry per generate call: mode, rows, tokens, seconds, forwards

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        start = time.perf_counter()
        # max_length=None: HF would otherwise warn that max_new_tokens overrides it
        out = super()._model_generate(context, None, stop, max_new_tokens=max_length - context.shape[1],
                                      return_dict_in_generate=True, **generation_kwargs)
        seconds = time.perf_counter() - start
        sequences = out.sequences
        stats = getattr(out, "recguide_stats", None)
        new = sequences[:, context.shape[1]:]
        mode = generation_kwargs.get("recguide_mode", getattr(self.model.generation_config, "recguide_mode", "ar"))
        self.recguide_calls.append({
            "mode": str(mode),
            "rows": int(sequences.shape[0]), "seconds": seconds,
            "generated_tokens": int((new != self.tokenizer.pad_token_id).sum()),
            "batched_forwards": None if stats is None else int(stats["forwards"]),
        })
        if stats is not None:
            self.recguide_requests.extend(stats["per_request"])
        return sequences

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = super().generate_until(requests, disable_tqdm=disable_tqdm)
        if self.world_size > 1:  # every rank runs generate_until once; pool the statistics on all of them
            from accelerate.utils import gather_object

            self.recguide_requests = gather_object(self.recguide_requests)
            self.recguide_calls = gather_object(self.recguide_calls)
        return results

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        calls = self.recguide_calls
        seconds = sum(c["seconds"] for c in calls)
        tokens = sum(c["generated_tokens"] for c in calls)
        info["recguide_stats"] = {
            "generate_calls": len(calls),
            "modes": sorted({c["mode"] for c in calls}),
            "generate_seconds": round(seconds, 3),
            "generated_tokens": tokens,  # non-pad tokens after the context, all rows (recguide and ar alike)
            "generated_tokens_per_second": round(tokens / seconds, 2) if seconds else 0.0,
            "batched_forwards": sum(c["batched_forwards"] or 0 for c in calls),
            **summarize(self.recguide_requests),
        }
        return info


def main() -> None:
    """The lm-eval CLI with the `recguide` backend registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
