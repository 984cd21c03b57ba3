"""The NLD stand-in with its PEFT drafting LoRA, plain reference decoders, and a model-folder writer.

* `standin(seed)`: the tiny random NLD-layout model (nld_standin_modeling.py) with a LoRA on every `o_proj`
  (random, non-zero A and B), injected in place by PEFT as NLD-8B's drafter adapter is.
* `linear_ss_reference(...)`: NLD's published LinearSS semantics written plainly, batch 1, on a DynamicCache:
  draft `[seed, MASK x (B-1)]` with the LoRA on and bidirectional attention without keeping the cache
  writes; verify `[seed, d_1 ..]` causally with the LoRA off; accept the matching prefix; crop the cache.
  Uses PEFT's own adapter switch and HF's own causal masking, none of the engine's code.
* `ar_greedy(...)`: plain batched greedy decoding with the LoRA off (one token per forward).
* `write_standin_folder(dir)`: a `trust_remote_code` model folder (config with `auto_map` -> AutoModel, the
  modeling file, weights, a character-level tokenizer) plus the LoRA as a PEFT adapter in `dir/draft_lora`.

Run `python tests/nld_standin.py DIR` to write such a folder.
"""

from __future__ import annotations

import inspect
import string
import sys
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nld_standin_modeling import NLDStandInConfig, NLDStandInModel  # noqa: E402

MASK, EOS, PAD = 100, 11, 0
VOCAB = 128


def standin_config(vocab: int = VOCAB, init_scale: float = 0.3, layers: int = 2) -> NLDStandInConfig:
    return NLDStandInConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=init_scale,
        eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1, mask_token_id=MASK, tie_word_embeddings=False,
        # NLD's YaRN + llama-4 attention scaling, with a small original context so that positions past 64
        # get a position-dependent query scale (exercises per-row position ids)
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 64,
                         "max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
                         "mscale": 1.0, "llama_4_scaling_beta": 0.1},
    )


def standin(seed: int = 0, lora: bool = True, lora_scale: float = 0.3, **config_kw) -> NLDStandInModel:
    """Random weights with a large init (peaked logits, so greedy is rarely near-tied) and a random LoRA."""
    torch.manual_seed(seed)
    model = NLDStandInModel(standin_config(**config_kw)).eval()
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


# ---------------------------------------------------------------------------------------------- references
def _forward(model, ids, cache, mask=None):
    return model.diffusion_head(model.encoder(input_ids=ids, attention_mask=mask, cache=cache,
                                              use_cache=True).last_hidden_state)


@torch.no_grad()
def linear_ss_reference(model, prompt: list[int], block: int, max_new_tokens: int, eos: int = EOS,
                        mask_id: int = MASK, prefill_all: bool = True):
    """NLD's LinearSS (DESIGN 2.1), batch 1, greedy. Returns (new token ids, accepted drafts per round).

    prefill_all=True is NLD's `linear_spec_generate`: the whole prompt is prefilled and the first new token
    comes from that prefill. prefill_all=False starts like the engine: the cache holds the prompt but its
    last token, which is the first seed (same output; rounds line up with the engine's).
    Drafts are the argmax with MASK excluded (DESIGN 2.1); MASK is never emitted.
    """
    ids = torch.tensor([prompt])
    cache = DynamicCache()
    set_lora(model, False)
    if prefill_all:
        first = _forward(model, ids, cache)[0, -1]
        first[mask_id] = float("-inf")
        seed = int(first.argmax())
        out = [seed]
        if seed == eos:
            return out, []
    else:
        if ids.shape[1] > 1:
            _forward(model, ids[:, :-1], cache)
        seed, out = prompt[-1], []
    rounds = []
    while len(out) < max_new_tokens:
        p = cache.get_seq_length()
        # draft: LoRA on, bidirectional over the block (explicit all-visible mask), cache writes dropped
        block_ids = torch.full((1, block), mask_id)
        block_ids[0, 0] = seed
        set_lora(model, True)
        draft_logits = _forward(model, block_ids, cache, mask=torch.zeros(1, 1, block, p + block))
        cache.crop(-block)
        draft_logits[..., mask_id] = float("-inf")
        drafts = draft_logits[0, 1:].argmax(-1)
        # verify: LoRA off, causal (HF's own causal mask), cache written
        set_lora(model, False)
        verify_ids = torch.cat([torch.tensor([seed]), drafts])[None]
        target_logits = _forward(model, verify_ids, cache)[0]
        target_logits[:, mask_id] = float("-inf")  # MASK is never emitted (as in the engine)
        target = target_logits.argmax(-1)  # a_0 .. a_{B-1}
        n = 0
        while n < block - 1 and int(target[n]) == int(drafts[n]):
            n += 1
        rounds.append(n)
        new = drafts[:n].tolist() + [int(target[n])]
        if n < block - 1:
            cache.crop(-(block - n - 1))  # keep seed + n accepted drafts
        if eos in new:
            out += new[: new.index(eos) + 1]
            break
        out += new
        seed = new[-1]
    return out[:max_new_tokens], rounds


@torch.no_grad()
def ar_greedy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
              eos: int = EOS, pad: int = PAD, mask_id: int = MASK) -> torch.Tensor:
    """Batched greedy decoding with the LoRA off: `[left-padded prompts | new tokens | pad after EOS]`.

    MASK is never emitted (as in the engine, which removes it from verifier scores)."""
    set_lora(model, False)
    ids = input_ids
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    cache = DynamicCache()
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    step_ids, out = ids, ids
    # transformers 5.24 calls it `cache`; remote code written for older versions only knows `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.encoder.forward).parameters else "past_key_values"
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        h = model.encoder(input_ids=step_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **{name: cache}).last_hidden_state
        logits = model.diffusion_head(h[:, -1]).float()
        logits[:, mask_id] = float("-inf")  # the engine never emits MASK either
        nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        done |= nxt == eos
        out = torch.cat([out, nxt[:, None]], 1)
        if bool(done.all()):
            break
        step_ids = nxt[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    width = input_ids.shape[1] + max_new_tokens
    return torch.nn.functional.pad(out, (0, width - out.shape[1]), value=pad)


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
        sys.exit("usage: python tests/nld_standin.py OUT_DIR")
    print(write_standin_folder(sys.argv[1]))
