"""The NLD stand-in with its PEFT drafting LoRA, reference decoders in NLD's own terms, and a model-folder writer.

* `standin(seed)`: the tiny random NLD-layout model (nld_standin_modeling.py: mask honoured only through
  `use_causal_mask=True`, llama-4 query scale from `cache_position`, every `diffusion_lm` flag True after
  loading) with a LoRA on every `o_proj` (random, non-zero A and B), injected in place by PEFT as NLD-8B's
  drafter adapter is. The llama-4 threshold is lowered to `llama4_threshold` (NLD-8B: 16384) so that short
  test sequences cross it and rows of a batch need different query scales.
* `linear_ss_reference(...)`: NLD's LinearSS semantics, batch 1, on a DynamicCache, with no attention mask at all:
  draft `[seed, MASK x (B-1)]` with the LoRA on and the `diffusion_lm` flags True (`use_cache=False`: the cache
  is read, not written, as NLD's `linear_spec_generate` drafts); verify with the LoRA off and the flags False,
  one token per forward (each sees its whole prefix, so no mask is needed), stopping at the first mismatch, so
  the cache ends holding the seed and the accepted drafts. None of the engine's code.
* `ar_greedy(...)`: NLD's own `ar_generate` (batch 1, explicit `cache_position`), LoRA off, row by row, laid
  out like HF's batched output: `[left-padded prompts | new tokens | pad after EOS]`.
* `write_standin_folder(dir)`: a `trust_remote_code` model folder (config with `auto_map` -> AutoModel, the
  modeling file, weights, a character-level tokenizer) plus the LoRA as a PEFT adapter in `dir/draft_lora`.

Run `python -m recguide_hf.testing.nld_standin DIR` to write such a folder.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from transformers import DynamicCache

from .nld_standin_modeling import NLDStandInConfig, NLDStandInModel

MASK, EOS, PAD = 100, 11, 0
VOCAB = 128
LLAMA4_THRESHOLD = 8  # positions from 8 on get a query scale above 1 (NLD-8B: 16384)


def standin_config(vocab: int = VOCAB, init_scale: float = 0.3, layers: int = 2,
                   llama4_threshold: int = LLAMA4_THRESHOLD, dlm_paradigm: str = "bidirectional") -> NLDStandInConfig:
    return NLDStandInConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=init_scale,
        eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1, mask_token_id=MASK, dlm_paradigm=dlm_paradigm,
        rope_parameters={"rope_theta": 1e6, "llama_4_scaling_beta": 0.5,
                         "original_max_position_embeddings": llama4_threshold},
    )


def standin(seed: int = 0, lora: bool = True, lora_scale: float = 0.3, **config_kw) -> NLDStandInModel:
    """Random weights with a large init (peaked logits, so greedy is rarely near-tied) and a random LoRA."""
    torch.manual_seed(seed)
    model = NLDStandInModel(standin_config(**config_kw)).eval()
    with torch.no_grad():  # a trained NLD never predicts MASK causally; random weights would (ar_generate keeps it)
        model.diffusion_head.weight[MASK] = 0
    if lora:
        add_lora(model, scale=lora_scale, seed=seed + 1)
    return model


def add_lora(model, scale: float = 0.3, seed: int = 1, rank: int = 4):
    """PEFT LoRA on every `o_proj` (NLD-8B: r=128, alpha=512; here r=4) with random non-zero weights."""
    inject_adapter_in_model(lora_config(rank), model)
    return randomize_lora(model, scale, seed)


def lora_config(rank: int = 4, **kw) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["o_proj"], lora_dropout=0.0, **kw)


def randomize_lora(model, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    for module in lora_layers(model):
        for lin in (module.lora_A["default"], module.lora_B["default"]):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) * scale
    return model


def lora_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def set_lora(model, on: bool):
    """NLD toggles its drafter adapter per phase: on for drafting, off for verification."""
    for module in lora_layers(model):
        module.enable_adapters(on)


def _unwrap(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ---------------------------------------------------------------------------------------------- references
def _logits(model, ids, cache, use_cache=True):
    """One encoder call with no mask (NLD's own draft and step calls); MASK never emitted (as in the engine)."""
    logits = model.diffusion_head(model.encoder(input_ids=ids, past_key_values=cache,
                                                use_cache=use_cache).last_hidden_state).float()
    logits[..., MASK] = float("-inf")
    return logits


@torch.no_grad()
def linear_ss_reference(model, prompt: list[int], block: int, max_new_tokens: int, eos: int = EOS,
                        mask_id: int = MASK, prefill_all: bool = True):
    """NLD's LinearSS (docs/algorithm.md §2.1), batch 1, greedy. Returns (new token ids, accepted drafts per round).

    prefill_all=True is NLD's `linear_spec_generate`: the whole prompt is prefilled and the first new token
    comes from that prefill. prefill_all=False starts like the engine: the cache holds the prompt but its
    last token, which is the first seed (same output; rounds line up with the engine's).
    """
    model = _unwrap(model)
    ids = torch.tensor([prompt])
    cache = DynamicCache()
    set_lora(model, False)
    model.set_diffusion_lm(False)
    if prefill_all:  # a causal prefill from an empty cache: SDPA's is_causal is exactly right, no mask needed
        seed = int(_logits(model, ids, cache)[0, -1].argmax())
        out = [seed]
        if seed == eos:
            return out, []
    else:
        if ids.shape[1] > 1:
            _logits(model, ids[:, :-1], cache)
        seed, out = prompt[-1], []
    rounds = []
    while len(out) < max_new_tokens:
        # draft: LoRA on, bidirectional (diffusion_lm flags), the cache read and not written
        block_ids = torch.full((1, block), mask_id)
        block_ids[0, 0] = seed
        set_lora(model, True)
        model.set_diffusion_lm(True)
        drafts = _logits(model, block_ids, cache, use_cache=False)[0, 1:].argmax(-1).tolist()
        set_lora(model, False)
        model.set_diffusion_lm(False)
        # verify: LoRA off, causal, one token per forward until the first mismatch (cache: seed + accepted)
        n, token = 0, seed
        while True:
            target = int(_logits(model, torch.tensor([[token]]), cache)[0, -1].argmax())
            if n == block - 1 or target != drafts[n]:
                break
            token, n = drafts[n], n + 1
        rounds.append(n)
        new = drafts[:n] + [target]
        if eos in new:
            out += new[: new.index(eos) + 1]
            break
        out += new
        seed = target
    model.set_diffusion_lm(True)  # as loading left them
    return out[:max_new_tokens], rounds


@torch.no_grad()
def ar_greedy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
              eos: int = EOS, pad: int = PAD, mask_id: int = MASK) -> torch.Tensor:
    """NLD's own `ar_generate` per row (its padding removed), LoRA off, laid out as HF's batched greedy output:
    `[left-padded prompts | new tokens | pad after EOS]`."""
    base = _unwrap(model)
    set_lora(base, False)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    rows = []
    for ids, keep in zip(input_ids, mask.bool()):
        prompt = ids[keep][None]
        out, _ = base.ar_generate(prompt, max_new_tokens, eos_token_id=eos)
        new = out[0, prompt.shape[1]:]
        rows.append(torch.cat([ids, new, torch.full((max_new_tokens - new.numel(),), pad, dtype=ids.dtype)]))
    base.set_diffusion_lm(True)  # as loading left them
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------- model folder
def char_tokenizer():
    """A character-level tokenizer over the stand-in's 128 ids: <pad>=0, <s>=1, </s>=11 (EOS), <mask>=100."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {PAD: "<pad>", 1: "<s>", 2: "<unk>", EOS: "</s>", MASK: "<mask>"}
    chars = iter(string.printable[:95] + "".join(chr(0x3B1 + i) for i in range(28)))  # ASCII, then Greek
    vocab = {}
    for i in range(VOCAB):
        vocab[specials[i] if i in specials else next(chars)] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", mask_token="<mask>", padding_side="left",
                                   model_input_names=["input_ids", "attention_mask"])


def write_standin_folder(path: str | Path, seed: int = 0) -> Path:
    """`dir/`: base model (AutoModel via trust_remote_code) + tokenizer; `dir/draft_lora/`: the PEFT adapter."""
    from peft import get_peft_model

    path = Path(path)
    base = standin(seed, lora=False)  # same weights as standin(seed), LoRA attached below
    NLDStandInConfig.register_for_auto_class("AutoConfig")
    NLDStandInModel.register_for_auto_class("AutoModel")  # config.json gets auto_map -> this modeling file
    base.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    peft_model = get_peft_model(base, lora_config())
    randomize_lora(peft_model, 0.3, seed + 1)
    peft_model.save_pretrained(path / "draft_lora")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m recguide_hf.testing.nld_standin OUT_DIR")
    print(write_standin_folder(sys.argv[1]))
