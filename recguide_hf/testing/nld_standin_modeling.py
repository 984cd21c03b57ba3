"""A tiny random stand-in for Nemotron-Labs-Diffusion (NLD) checkpoints (docs/algorithm.md §4), written from what NLD's
published remote code is known to do (issue 30), not from transformers' own Ministral3 classes:

* layout: `model.encoder` (a Ministral3-style decoder) + `model.diffusion_head` (Linear to the vocabulary);
  logits = `diffusion_head(encoder(...).last_hidden_state)`; mask id 100, EOS 11;
* the encoder's forward takes the pre-5.24 cache name `past_key_values` (plus `**kwargs`, so a `cache=` keyword
  is silently lost), derives `cache_position` from the cache's length when none is given, and honours an
  explicit attention mask ONLY when called with `use_causal_mask=True`, through transformers'
  `create_causal_mask` called with the keyword names of transformers 5.0 (`input_embeds`, `cache_position`,
  `past_key_values`: a TypeError from 5.9 on, where they were renamed or dropped); without it no mask reaches
  attention (SDPA's `is_causal` for a multi-token query, nothing for one token);
* each attention layer reads its `diffusion_lm` flag (True: bidirectional, `attention_mask=None,
  is_causal=False`; False: the mask above), and after loading every flag is True (NLD's
  `dlm_paradigm="bidirectional"`); `use_cache=False` reads the cache without writing it (NLD's draft step);
* the llama-4 query scale `1 + beta * log(1 + floor(cache_position / original_max_position_embeddings))`
  multiplies the queries, read from `cache_position` (not from position ids): NLD-8B's threshold is 16384,
  tests lower it so that short sequences cross it;
* `dlm_paradigm="block_diff"` builds a flex-attention class that never reads `attention_mask`;
* NLD's own `ar_generate(prompt_ids, max_new_tokens, ...) -> (ids, nfe)`: batch 1, flags set False, a fresh
  `DynamicCache`, `cache_position` given explicitly, never `use_causal_mask`.

The drafting LoRA is attached with PEFT afterwards (`tests/nld_standin.py`), as NLD-8B's adapter is. This file
imports only torch and transformers so that it can be copied into a model folder and loaded with
`AutoModel.from_pretrained(dir, trust_remote_code=True)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import ModelOutput


class NLDStandInConfig(PretrainedConfig):
    model_type = "nld_standin"

    def __init__(self, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                 rms_norm_eps=1e-5, rope_parameters=None, initializer_range=0.02, mask_token_id=100,
                 block_size=32, dlm_paradigm="bidirectional", **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.head_dim = num_key_value_heads, head_dim
        self.max_position_embeddings, self.rms_norm_eps = max_position_embeddings, rms_norm_eps
        # NLD-8B: rope_theta 1e6, llama_4_scaling_beta 0.1, original_max_position_embeddings 16384
        self.rope_parameters = rope_parameters or {"rope_theta": 1e6, "llama_4_scaling_beta": 0.1,
                                                   "original_max_position_embeddings": 16384}
        self.initializer_range, self.mask_token_id, self.block_size = initializer_range, mask_token_id, block_size
        self.dlm_paradigm = dlm_paradigm
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def llama_4_attn_scale(cache_position: torch.Tensor, beta: float, original_max: int) -> torch.Tensor:
    """The query scale per position, with a trailing axis for the head dimension (as NLD computes it)."""
    return (1 + beta * torch.log(1 + torch.floor(cache_position.float() / original_max))).unsqueeze(-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], -1)


class NLDStandInAttention(nn.Module):
    def __init__(self, config: NLDStandInConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, h, kv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.q_proj, self.k_proj = nn.Linear(d, h * hd, bias=False), nn.Linear(d, kv * hd, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, kv * hd, bias=False), nn.Linear(h * hd, d, bias=False)
        self.diffusion_lm = True

    def project(self, hidden, cos, sin, cache_position, past_key_values, use_cache):
        b, q_len, _ = hidden.shape
        # heads from the projections' widths, as Ministral3's attention reads them (a tensor-parallel rank holds a
        # slice of the heads)
        q = self.q_proj(hidden).view(b, q_len, -1, self.head_dim).transpose(1, 2)  # [B, H, Q, hd]
        k = self.k_proj(hidden).view(b, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden).view(b, q_len, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rope = self.config.rope_parameters
        q = q * llama_4_attn_scale(cache_position, rope["llama_4_scaling_beta"],
                                   rope["original_max_position_embeddings"]).to(q.dtype)
        if past_key_values is not None:
            if use_cache:
                k, v = past_key_values.update(k, v, self.layer_idx, {"cache_position": cache_position})
            elif past_key_values.get_seq_length(self.layer_idx) > 0:  # read the prefix, write nothing
                layer = past_key_values.layers[self.layer_idx]
                k, v = torch.cat([layer.keys, k], 2), torch.cat([layer.values, v], 2)
        groups = self.num_heads // self.num_kv_heads
        return q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)

    def forward(self, hidden, cos, sin, attention_mask, cache_position, past_key_values=None, use_cache=False):
        q, k, v = self.project(hidden, cos, sin, cache_position, past_key_values, use_cache)
        if self.diffusion_lm:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False)
        elif attention_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[..., :k.shape[-2]])
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)
        return self.o_proj(out.transpose(1, 2).reshape(hidden.shape[0], hidden.shape[1], -1))


class NLDStandInFlexAttention(NLDStandInAttention):
    """`dlm_paradigm="block_diff"`: its own block mask (here: bidirectional), never the caller's."""

    def forward(self, hidden, cos, sin, attention_mask, cache_position, past_key_values=None, use_cache=False):
        q, k, v = self.project(hidden, cos, sin, cache_position, past_key_values, use_cache)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(hidden.shape[0], hidden.shape[1], -1))


class NLDStandInMLP(nn.Module):
    def __init__(self, config: NLDStandInConfig):
        super().__init__()
        d, m = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(d, m, bias=False), nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NLDStandInLayer(nn.Module):
    """Ministral3's decoder layer layout: `self_attn`, `mlp`, two norms."""

    def __init__(self, config: NLDStandInConfig, layer_idx: int):
        super().__init__()
        attn = NLDStandInFlexAttention if config.dlm_paradigm == "block_diff" else NLDStandInAttention
        self.self_attn = attn(config, layer_idx)
        self.mlp = NLDStandInMLP(config)
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, mask, cache_position, past_key_values, use_cache):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, cache_position,
                                         past_key_values, use_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class NLDStandInEncoder(nn.Module):
    """NLD's Ministral3 decoder, as its remote file behaves (see the module docstring)."""

    def __init__(self, config: NLDStandInConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NLDStandInLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary(self, position_ids: torch.Tensor):
        hd = self.config.head_dim
        exponents = torch.arange(0, hd, 2, device=position_ids.device).float() / hd
        inv_freq = 1.0 / (self.config.rope_parameters["rope_theta"] ** exponents)
        freqs = position_ids[..., None].float() * inv_freq  # [B, Q, hd/2]
        emb = torch.cat([freqs, freqs], -1)[:, None]  # [B, 1, Q, hd]
        return emb.cos(), emb.sin()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, cache_position=None, use_causal_mask=False, is_training=False, **kwargs):
        hidden = self.embed_tokens(input_ids)
        if cache_position is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        mask = None
        if use_causal_mask:  # transformers 5.0's keyword names
            mask = create_causal_mask(config=self.config, input_embeds=hidden, attention_mask=attention_mask,
                                      cache_position=cache_position, past_key_values=past_key_values,
                                      position_ids=position_ids)
        cos, sin = (t.to(hidden.dtype) for t in self.rotary(position_ids))
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask, cache_position, past_key_values, use_cache)
        # transformers' own output class, as 5.0's Ministral3Model returns it (5.24 maps the field to `cache`)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=past_key_values)


@dataclass
class NLDStandInOutput(ModelOutput):
    """NLD's own output class has a `past_key_values` field: under transformers 5.24, whose ModelOutput maps that
    keyword to `cache`, constructing it fails, so `model(...)` does (NLD's does too); the encoder path does not."""

    logits: torch.Tensor | None = None
    past_key_values: object | None = None


class NLDStandInModel(PreTrainedModel):
    config_class = NLDStandInConfig
    base_model_prefix = "encoder"
    _supports_sdpa = True
    _no_split_modules = ["NLDStandInLayer"]  # a device map keeps a decoder layer whole (Ministral3's rule)

    def __init__(self, config: NLDStandInConfig):
        super().__init__(config)
        self.mask_token_id = config.mask_token_id
        self.encoder = NLDStandInEncoder(config)
        self.diffusion_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():  # random weights at construction; from_pretrained then loads over them
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.normal_(0.0, config.initializer_range)
        self.post_init()
        self.set_diffusion_lm(config.dlm_paradigm != "autoregressive")  # NLD: bidirectional after loading

    def _init_weights(self, module):
        """Nothing: transformers 5.0 runs this after loading too, over the loaded weights."""

    def get_input_embeddings(self):
        return self.encoder.embed_tokens

    def set_diffusion_lm(self, value: bool):
        for layer in self.encoder.layers:
            layer.self_attn.diffusion_lm = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, **kwargs)
        return NLDStandInOutput(logits=self.diffusion_head(out.last_hidden_state),
                                past_key_values=out.past_key_values)

    @torch.no_grad()
    def ar_generate(self, prompt_ids: torch.Tensor, max_new_tokens: int = 128, eos_token_id: int | None = None):
        """NLD's own plain greedy decoding: batch 1, no padding; returns `(ids, nfe)`."""
        if prompt_ids.shape[0] != 1:
            raise ValueError("ar_generate supports batch size 1 only")
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        self.set_diffusion_lm(False)
        cache, n = DynamicCache(), prompt_ids.shape[1]
        where = prompt_ids.device
        out = self.encoder(input_ids=prompt_ids, position_ids=torch.arange(n, device=where)[None],
                           past_key_values=cache, use_cache=True, cache_position=torch.arange(n, device=where))
        ids, nfe = prompt_ids, 1
        for step in range(max_new_tokens):
            nxt = self.diffusion_head(out.last_hidden_state[:, -1]).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if int(nxt) == eos or step == max_new_tokens - 1:
                break
            pos = torch.tensor([n + step], device=where)
            out = self.encoder(input_ids=nxt, position_ids=pos[None], past_key_values=cache, use_cache=True,
                               cache_position=pos)
            nfe += 1
        return ids, nfe

