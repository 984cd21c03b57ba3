"""Shared fixtures: small randomly initialised models of the project's class (parity needs no training)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from recguide_hf import RecGuideConfig, RecGuideForCausalLM
from recguide_hf.core import masks
from recguide_hf.core.masks import build_mask, causal_intra, positions
from recguide_hf.testing.split_check import layout_tolerance

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


def assert_close_layouts(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 64):
    """Two computation layouts of the same floats (other kernels, groupings or query widths) agree to rounding,
    not bit for bit: fp32 rounds at 2**-23 of the values' scale per operation, and `ulps` of the scale covers
    the reordered sums of these 2-layer test models with room while staying ~1e-5 of the scale, far below what
    a real layout bug moves (a query seeing one wrong key, a LoRA on the wrong token: a sizeable fraction)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=layout_tolerance(expected, ulps))


def random_prompts(n: int, vocab: int, min_len: int = 1, max_len: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for length in lengths]


def left_pad(prompts, pad: int = PAD):
    return masks.left_pad(prompts, pad)


@pytest.fixture(scope="session")
def model():
    return tiny_model()


def fused_forward(bb, prompt, verify, branch, branch_start, draft_on=True, suffix=False):
    """One row: cache holds prompt[:-1]; verifier segment `verify` (= [seed, d_1 ..], causal) and one branch
    segment `branch` (= [c_p, MASK ..], bidirectional) that sees the verifier tokens before `branch_start`.
    The branch drafts by a [1, Q] bool mask, or with `suffix` as the engine routes it (`draft_mask=len(verify)`)."""
    cache = bb.new_cache(1, 64)
    rows, pads = torch.tensor([0]), torch.tensor([0])
    n = len(prompt) - 1
    cache.bind(rows, n)
    bb.forward(torch.tensor([prompt[:-1]]), torch.arange(n)[None], build_mask(
        torch.tensor([0]), pads, causal_intra(1, n), n), cache)
    cache.commit(rows, torch.tensor([n]))
    q, b = len(verify), len(branch)
    intra = torch.zeros(1, q + b, q + b, dtype=torch.bool)
    intra[:, :q, :q] = causal_intra(1, q)
    intra[:, q:, :branch_start] = True
    intra[:, q:, q:] = True
    offsets = torch.cat([torch.arange(q), branch_start + torch.arange(b)])[None]
    draft_mask = (q if draft_on else None) if suffix else torch.tensor([[False] * q + [draft_on] * b])
    kv = cache.bind(rows, q + b)
    lengths = cache.lengths[rows]
    logits = bb.forward(torch.tensor([verify + branch]), positions(lengths, pads, offsets),
                        build_mask(lengths, pads, intra, kv), cache, draft_mask=draft_mask)
    return logits[0, :q], logits[0, q:]
