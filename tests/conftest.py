"""Shared fixtures: small randomly initialised models of the project's class (parity needs no training)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from recguide_hf import RecGuideConfig, RecGuideForCausalLM

EOS, PAD, MASK = 1, 2, 3


def tiny_model(seed: int = 0, vocab: int = 96, init_scale: float = 0.3, layers: int = 2) -> RecGuideForCausalLM:
    """A random model with peaked logits (large init) so greedy choices are rarely near-ties."""
    torch.manual_seed(seed)
    config = RecGuideConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                            bos_token_id=0, eos_token_id=EOS, pad_token_id=PAD, mask_token_id=MASK,
                            initializer_range=init_scale, tie_word_embeddings=False, block_size=8)
    model = RecGuideForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=PAD, suppress_tokens=[MASK])
    return model


def random_prompts(n: int, vocab: int, min_len: int = 1, max_len: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for length in lengths]


def left_pad(prompts, pad: int = PAD):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@pytest.fixture(scope="session")
def model():
    return tiny_model()
