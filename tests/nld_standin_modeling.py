"""A tiny random stand-in for Nemotron-Labs-Diffusion (NLD) checkpoints (DESIGN 4).

Same attribute layout as NLD's published remote code: `model.encoder` is transformers' Ministral3 decoder
(`Ministral3Model`), `model.diffusion_head` a Linear to the vocabulary, logits =
`diffusion_head(encoder(...).last_hidden_state)`, and every `layer.self_attn` carries a `diffusion_lm`
flag (False). Mask id 100 and EOS 11 as in NLD. Like NLD's `AutoModel` class it is not a `GenerationMixin`
subclass here (tests add one to cover that case too). The drafting LoRA is attached with PEFT afterwards
(`tests/nld_standin.py`), as NLD-8B's adapter is.

This file imports only torch and transformers so that it can be copied into a model folder as
`modeling_nld_standin.py` and loaded with `AutoModel.from_pretrained(dir, trust_remote_code=True)`.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import Ministral3Config
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.ministral3.modeling_ministral3 import Ministral3Model, Ministral3PreTrainedModel


@strict
class NLDStandInConfig(Ministral3Config):
    model_type = "nld_standin"
    mask_token_id: int = 100
    block_size: int = 32


class NLDStandInModel(Ministral3PreTrainedModel):
    config_class = NLDStandInConfig
    base_model_prefix = "encoder"

    def __init__(self, config: NLDStandInConfig):
        super().__init__(config)
        self.mask_token_id = config.mask_token_id
        self.encoder = Ministral3Model(config)
        for layer in self.encoder.layers:
            layer.self_attn.diffusion_lm = False  # NLD's per-layer attention-mode switch (causal)
        self.diffusion_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                past_key_values=None, **kwargs) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           cache=cache, use_cache=use_cache, **kwargs)
        return CausalLMOutputWithPast(logits=self.diffusion_head(out.last_hidden_state), cache=out.cache)

    @torch.no_grad()
    def ar_generate(self, prompt_ids: torch.Tensor, max_new_tokens: int = 128, eos_token_id: int | None = None):
        """NLD's own method name and return shape `(ids, nfe)`: plain greedy, batch 1, no padding."""
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        ids, nfe = prompt_ids, 0
        for _ in range(max_new_tokens):
            logits = self(input_ids=ids).logits[:, -1]
            nfe += 1
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
            if int(ids[0, -1]) == eos:
                break
        return ids, nfe
