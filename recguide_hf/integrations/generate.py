"""`recguide_hf.generate(model, ...)`: the engine behind HF's `model.generate` interface.

HF's own `generate` does all the preparation (GenerationConfig merging, `max_length`, special tokens,
logits processors, stopping criteria) and then calls a decoding method; we hand it ours through the
public `custom_generate=<callable>` hook. `recguide_mode="ar"` is plain HF generation, untouched.
The model folder's `custom_generate/generate.py` is a shim that calls this function.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..core.config import DecodingConfig
from ..core.engine import Engine, SamplingSettings
from ..core.policy import OnlinePrices
from ..core.stats import branch_status
from ..models.registry import as_backbone
from .processors import ScoreProcessor
from .stopping import StopChecker

logger = logging.getLogger("recguide_hf")
if os.environ.get("RECGUIDE_LOG_LEVEL"):  # e.g. RECGUIDE_LOG_LEVEL=INFO: see RecGuide's lines in lm-eval runs
    logger.setLevel(os.environ["RECGUIDE_LOG_LEVEL"].upper())
    logger.addHandler(logging.StreamHandler())


@dataclass
class RecGuideGenerateOutput(GenerateDecoderOnlyOutput):
    """HF's decoder-only output plus `recguide_stats` (see stats.py for the fields)."""

    recguide_stats: dict | None = None


def generate(*args, **kwargs):
    """Generate with RecGuide; same arguments as `model.generate`, plus the `recguide_*` settings.

    Call as `generate(model, input_ids, ...)` or, from a model folder's shim, `generate(input_ids, model=m)`.
    """
    if "model" in kwargs:
        model = kwargs.pop("model")
    else:
        model, args = args[0], args[1:]
    settings = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith("recguide_")}
    if not isinstance(model, GenerationMixin):  # e.g. NLD's AutoModel class, or a PEFT wrapper around it
        return _generate_direct(model, args, kwargs, settings)
    gen_config = kwargs.get("generation_config") or model.generation_config
    config = DecodingConfig.from_sources(gen_config, **settings)  # validates every recguide_* key
    if config.mode == "ar":
        return GenerationMixin.generate(model, *args, **kwargs)
    _check_supported(gen_config, kwargs)
    _move_stop_strings(gen_config, kwargs)
    # HF hands a custom decoding callable no streamer (and would put the prompt itself): `_decode` streams instead
    streamer = kwargs.pop("streamer", None)
    return GenerationMixin.generate(model, *args, custom_generate=_decode, recguide_config=config,
                                    recguide_streamer=streamer, **kwargs)


def _move_stop_strings(gen_config, kwargs):
    """HF drops the `tokenizer` argument on the way to a custom decoding callable, so stop strings would fail
    there; build their criterion here and hand it over with the other stopping criteria instead."""
    stop_strings = kwargs.pop("stop_strings", None) or getattr(gen_config, "stop_strings", None)
    if not stop_strings:
        return
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("stop_strings need the model's tokenizer: pass tokenizer= to generate")
    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), criterion])
    if getattr(gen_config, "stop_strings", None):
        gen_config = copy.deepcopy(gen_config)
        gen_config.stop_strings = None
        kwargs["generation_config"] = gen_config


def _check_supported(gen_config, kwargs):
    def get(name, default=None):
        return kwargs.get(name, getattr(gen_config, name, default))

    problems = []
    if (get("num_beams", 1) or 1) > 1:
        problems.append("beam search (num_beams > 1)")
    if (get("num_return_sequences", 1) or 1) > 1:
        problems.append("num_return_sequences > 1")
    if kwargs.get("assistant_model") is not None or get("prompt_lookup_num_tokens") is not None:
        problems.append("assisted generation with another assistant (assistant_model / prompt_lookup_num_tokens)")
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if get(flag, False):
            problems.append(flag)
    if problems:
        raise ValueError(f"RecGuide decoding does not support {', '.join(problems)}; pass recguide_mode='ar' "
                         "for plain Hugging Face generation")


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
            streamer=None, recguide_config: DecodingConfig | None = None, recguide_streamer=None, **model_kwargs):
    """The decoding method HF calls after its own preparation (signature of `GenerationMixin._sample`).

    A streamer (HF's protocol) gets the prompt once, then each round's emitted tokens, then `end()`, always: also
    when decoding stops early or raises, so a consumer waiting on a `TextIteratorStreamer` never hangs."""
    streamer = streamer or recguide_streamer
    if streamer is None:
        return _decode_batch(model, input_ids, generation_config, recguide_config, logits_processor,
                             stopping_criteria, model_kwargs.get("attention_mask"))
    try:
        if input_ids.shape[0] != 1:
            raise ValueError(f"streamer= needs a batch of one prompt, as Hugging Face's streamers do; got "
                             f"{input_ids.shape[0]}")
        streamer.put(input_ids.cpu())
        return _decode_batch(model, input_ids, generation_config, recguide_config, logits_processor,
                             stopping_criteria, model_kwargs.get("attention_mask"),
                             on_tokens=lambda row, ids: streamer.put(ids.cpu()))
    finally:
        streamer.end()


def _decode_batch(model, input_ids, generation_config, recguide_config, logits_processor, stopping_criteria,
                  attention_mask, on_tokens=None):
    config = recguide_config or DecodingConfig.from_sources(generation_config)
    backbone = as_backbone(model)
    if getattr(backbone, "tp_group", None) is not None:  # every rank must stop where the others do
        if any(isinstance(c, MaxTimeCriteria) for c in stopping_criteria or []):
            raise ValueError("max_time (MaxTimeCriteria) would stop tensor-parallel ranks at different rounds; "
                             "bound the call by max_new_tokens instead")
    eos = generation_config._eos_token_tensor
    eos_ids = [] if eos is None else [int(t) for t in eos.flatten().tolist()]
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    settings = SamplingSettings(
        max_new_tokens=generation_config.max_length - input_ids.shape[1], eos_token_ids=eos_ids,
        pad_token_id=pad_id, do_sample=bool(generation_config.do_sample),
        draft_temperature=float(generation_config.temperature or 1.0),
    )
    # the auto policy's measured prices carry over from call to call of this model (one per cost table)
    prices = model.__dict__.setdefault("_recguide_prices", {}).setdefault(config.cost_table, OnlinePrices())
    engine = Engine(backbone, config, settings, ScoreProcessor(logits_processor, backbone.mask_token_id),
                    StopChecker(stopping_criteria, pad_id), base_dir=getattr(model.config, "_name_or_path", None),
                    prices=prices)
    sequences, stats = engine.generate(input_ids, attention_mask, on_tokens=on_tokens)
    summary = stats.as_dict()
    summary["branches"] = branch_status(config.branches_enabled, summary)
    if engine.compile_warmup_s is not None:
        summary["compile_warmup_s"] = engine.compile_warmup_s  # seconds of this call's forwards that compiled
    _RUN.record(config, summary)
    if generation_config.return_dict_in_generate:
        return RecGuideGenerateOutput(sequences=sequences, recguide_stats=summary)
    return sequences


def _say(message: str, *args):
    """INFO on the `recguide_hf` logger (silent unless RECGUIDE_LOG_LEVEL or the application enables it); inside
    an lm-evaluation-harness run also on a child of lm-eval's own logger, so its output says which decoding ran."""
    logger.info(message, *args)
    if "lm_eval" in sys.modules and not logger.isEnabledFor(logging.INFO):
        logging.getLogger("lm_eval.recguide_hf").info(message, *args)


class _RunLog:
    """What this process decoded with RecGuide (`_say`): one line at the first `generate` call (so an lm-eval run
    shows RecGuide is in use) and one with the totals at exit; DEBUG adds a line per call."""

    def __init__(self):
        self.calls, self.new_tokens, self.forwards, self.rounds, self.blocks = 0, 0, 0, 0, Counter()

    def record(self, config: DecodingConfig, summary: dict):
        self.calls += 1
        self.new_tokens += summary["new_tokens"]
        self.forwards += summary["request_forwards"]
        self.rounds += summary["rounds"]
        self.blocks.update(summary["block_sizes"])
        line = (f"mode={config.mode} block_size={config.block_size} TPF {summary['tpf']:.2f} tau {summary['tau']:.2f}"
                f" block mix {dict(sorted(summary['block_sizes'].items()))} branches {summary['branches']}")
        if self.calls == 1:
            _say("RecGuide decoding (first generate call): %s", line)
            atexit.register(self.totals)
        else:
            logger.debug("RecGuide generate call %d: %s", self.calls, line)

    def totals(self):
        _say("RecGuide totals over %d generate calls: %d new tokens, TPF %.2f, tau %.2f, block mix %s",
             self.calls, self.new_tokens, self.new_tokens / max(self.forwards, 1),
             self.new_tokens / max(self.rounds, 1), dict(sorted(self.blocks.items())))


_RUN = _RunLog()


# ---------------------------------------------------------------- models without HF's GenerationMixin
_DIRECT_KEYS = {"input_ids", "inputs", "attention_mask", "generation_config", "max_new_tokens", "max_length",
                "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_k", "top_p", "logits_processor",
                "stopping_criteria", "return_dict_in_generate", "streamer", "token_type_ids"}


def _generate_direct(model, args, kwargs, settings):
    """What HF's `generate` would prepare, for a model that has no `GenerationMixin`, then `_decode`.

    Resolves lengths, EOS / pad (call > generation config > model config), greedy or sampling with
    temperature / top-k / top-p, and the caller's logits processors and stopping criteria; anything else is
    refused rather than silently ignored.
    """
    unknown = sorted(set(kwargs) - _DIRECT_KEYS)
    if unknown:
        raise ValueError(f"{type(model).__name__} is not a transformers GenerationMixin; RecGuide's direct path "
                         f"supports {sorted(_DIRECT_KEYS)}, not {unknown}")
    input_ids = args[0] if args else kwargs.pop("input_ids", kwargs.pop("inputs", None))
    gen_config = copy.deepcopy(kwargs.pop("generation_config", None) or getattr(model, "generation_config", None)
                               or GenerationConfig())
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(gen_config, name, None) is None:
            setattr(gen_config, name, getattr(model.config, name, None))
    own = ("logits_processor", "stopping_criteria", "streamer", "attention_mask", "input_ids", "inputs",
           "token_type_ids")  # a tokenizer's token_type_ids mean nothing to a decoder-only model
    gen_config.update(**{k: v for k, v in kwargs.items() if k not in own})
    config = DecodingConfig.from_sources(gen_config, **settings)
    if config.mode == "ar":
        raise ValueError("recguide_mode='ar' is Hugging Face's own generate, which this model does not have")
    if gen_config.max_new_tokens is not None:
        gen_config.max_length = input_ids.shape[1] + gen_config.max_new_tokens
    elif gen_config.max_length is None:
        gen_config.max_length = 20  # HF's default total length
    eos = gen_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    gen_config._eos_token_tensor = torch.tensor(eos) if eos else None
    pad = gen_config.pad_token_id
    gen_config._pad_token_tensor = torch.tensor(pad) if pad is not None else None
    processors = LogitsProcessorList(kwargs.get("logits_processor") or [])
    if gen_config.do_sample:
        if gen_config.temperature not in (None, 1.0):
            processors.append(TemperatureLogitsWarper(gen_config.temperature))
        if gen_config.top_k:
            processors.append(TopKLogitsWarper(gen_config.top_k))
        if gen_config.top_p not in (None, 1.0):
            processors.append(TopPLogitsWarper(gen_config.top_p))
    return _decode(model, input_ids, processors, StoppingCriteriaList(kwargs.get("stopping_criteria") or []),
                   gen_config, streamer=kwargs.get("streamer"), recguide_config=config,
                   attention_mask=kwargs.get("attention_mask"))
