"""The HF-native pair: drafting inside HF's own assisted-decoding loop, and a signal-recording processor.

`SelfDraftCandidateGenerator` drafts with the target model itself: a block-diffusion forward over
`[seed, MASK x (B-1)]` on the target's own cache, cropped back afterwards, so HF's `_assisted_decoding`
runs LinearSS (batch size 1, as HF's loop requires). HF has no public `candidate_generator=` argument;
`assisted_generate` is a `custom_generate` callable that runs HF's loop with this generator:

    model.generate(input_ids, custom_generate=recguide_hf.integrations.hf_assist.assisted_generate, max_new_tokens=64)

`EntropyRecorder` is a `LogitsProcessor` that returns scores unchanged and records per-position verifier
entropy, the signal the adaptive block-size policy reads (docs/algorithm.md §2.3).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationMixin, LogitsProcessor
from transformers.generation.candidate_generator import CandidateGenerator

from ..models.compat import CACHE_KW


class SelfDraftCandidateGenerator(CandidateGenerator):
    """Candidates = the shared backbone's block draft after the current sequence.

    Args:
        model: a self-speculative model with `draft_logits` (RecGuideForCausalLM).
        block_size: B; at most B - 1 candidates per round.
        max_length: HF's max_length, so candidates never run past it.
    """

    requires_model_outputs = True  # HF then passes the target's cache in model_kwargs
    model_kwargs_overrides: dict = {}

    def __init__(self, model, block_size: int, max_length: int):
        self.model, self.block_size, self.max_length = model, block_size, max_length
        self.mask_token_id = model.config.mask_token_id

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs=None, is_first_iteration=False, **kwargs):
        # input_ids: [1, T]; the target's cache holds all but the last token (the seed)
        num_drafts = min(self.block_size - 1, self.max_length - input_ids.shape[1] - 1)
        if isinstance(model_kwargs, bool):  # transformers < 5.24: get_candidates(input_ids, is_first_iteration)
            model_kwargs, is_first_iteration = None, model_kwargs
        if model_kwargs is None and not is_first_iteration and num_drafts > 0 and input_ids.shape[1] > 1:
            # that loop hands the generator no cache: encode the prefix (the seed excluded) here, causally
            cache = DynamicCache()
            self.model(input_ids=input_ids[:, :-1], use_cache=True, **{CACHE_KW: cache})
        else:
            cache = (model_kwargs or {}).get(CACHE_KW)
        if is_first_iteration or cache is None or num_drafts <= 0 or cache.get_seq_length() != input_ids.shape[1] - 1:
            return input_ids, None  # no prefix cache yet (prefill round): no candidates
        logits = self.model.draft_logits(input_ids[:, -1], cache, cache.get_seq_length(), num_drafts + 1)
        draft_logits = logits[:, 1:].float()  # [1, K, V]; MASK at j predicts the token at j
        draft_logits[..., self.mask_token_id] = float("-inf")
        return torch.cat([input_ids, draft_logits.argmax(-1)], dim=1), draft_logits

    @property
    def num_drafting_tokens(self) -> int:
        """Candidates per round at most (transformers >= 5.25 sizes the cache's past recording by it)."""
        return self.block_size - 1

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


class EntropyRecorder(LogitsProcessor):
    """Pass scores through unchanged; keep the entropy of each scored position (`entropies`, list of [B])."""

    def __init__(self):
        self.entropies: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp = torch.log_softmax(scores.float(), dim=-1)
        self.entropies.append(-(logp.exp() * logp).nan_to_num().sum(-1).detach().cpu())
        return scores


def assisted_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                      streamer=None, recguide_block_size: int | None = None, **model_kwargs):
    """A `custom_generate` decoding method: HF's `_assisted_decoding` with `SelfDraftCandidateGenerator`."""
    block = int(recguide_block_size or getattr(model.config, "block_size", 16))
    generator = SelfDraftCandidateGenerator(model, block, generation_config.max_length)
    model._get_candidate_generator = lambda **kw: generator  # the loop's only hook; removed below
    try:
        return GenerationMixin._assisted_decoding(model, input_ids, logits_processor, stopping_criteria,
                                                  generation_config, synced_gpus, streamer, **model_kwargs)
    finally:
        del model._get_candidate_generator
