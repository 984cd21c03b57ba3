"""A tiny random Llama-style causal LM folder for tests of `recguide distill` (no MASK token, no drafting adapter).

It borrows the bundled model's tokenizer (which has a `<|mask|>` token: `recguide distill` takes it by default, or
adds another named by `--mask-token`) and gives it a ChatML-style chat template, so both prompt kinds are exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from .. import BUNDLED_MODEL

CHATML = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def write_tiny_llama(folder: Path, seed: int = 0, layers: int = 2, hidden: int = 64, vocab_pad: int = 0) -> Path:
    """The model and tokenizer in `folder`; `vocab_pad` extra embedding rows past the tokenizer (as Qwen pads)."""
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL, trust_remote_code=True)
    tokenizer.chat_template = CHATML
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer) + vocab_pad, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a peaked random model: greedy continuations that are not all one token
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
