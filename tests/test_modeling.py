"""The model class: both attention modes through one forward, both cache names, the Hub folder."""

import os

import pytest
import torch
from conftest import MASK, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from recguide_hf import BUNDLED_MODEL
from recguide_hf.models.cache import RowCache
from recguide_hf.models.export import save_model_folder

BUNDLED = str(BUNDLED_MODEL)


def test_draft_forward_shape_and_cache_untouched(model):
    prefix = torch.tensor([[5, 6, 7, 8]])
    cache = DynamicCache(config=model.config)
    model(prefix, cache=cache, use_cache=True)
    keys_before = cache.layers[0].keys.clone()
    logits = model.draft_logits(torch.tensor([9]), cache, prefix_len=4, block_size=8)
    assert logits.shape == (1, 8, model.config.vocab_size)
    assert cache.get_seq_length() == 4 and torch.equal(cache.layers[0].keys, keys_before)


def test_draft_block_is_bidirectional(model):
    # changing the LAST token of a draft block changes the logits at its FIRST position (not so in causal mode)
    prefix = torch.tensor([[5, 6, 7]])
    outs = []
    for last in (MASK, 11):
        cache = DynamicCache(config=model.config)
        model(prefix, cache=cache, use_cache=True)
        ids = torch.tensor([[9, MASK, MASK, last]])
        mask = torch.zeros(1, 1, 4, 7)
        outs.append(model(ids, position_ids=torch.arange(3, 7)[None], attention_mask=mask, cache=cache).logits)
    assert not torch.allclose(outs[0][0, 0], outs[1][0, 0])


def test_both_cache_argument_names(model):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    results = []
    for name in ("cache", "past_key_values"):
        cache = DynamicCache(config=model.config)
        model(ids[:, :3], use_cache=True, **{name: cache})
        assert cache.get_seq_length() == 3, name
        results.append(model(ids[:, 3:], use_cache=True, **{name: cache}).logits)
    full = model(ids).logits[:, 3:]
    assert torch.allclose(results[0], full, atol=1e-5) and torch.allclose(results[1], full, atol=1e-5)


def test_logits_to_keep_and_custom_cache_subclass(model):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    full = model(ids).logits
    assert model(ids, logits_to_keep=2).logits.shape[1] == 2
    cache = RowCache.for_model(model, num_rows=1, capacity=16)
    cache.bind(torch.tensor([0]), 6)
    causal = torch.zeros(1, 1, 6, 6).masked_fill(torch.ones(6, 6).triu(1).bool(), torch.finfo(torch.float32).min)
    out = model(ids, attention_mask=causal, position_ids=torch.arange(6)[None], cache=cache, use_cache=True).logits
    assert torch.allclose(out, full, atol=1e-5)


def test_save_load_round_trip_exact(tmp_path):
    model = tiny_model(seed=5)
    save_model_folder(model, None, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.generation_config.recguide_mode == "recguide"


def test_folder_code_is_the_package(tmp_path):
    """The folder's shims resolve to the installed package's objects: no drifting twin."""
    import recguide_hf

    model = tiny_model(seed=6)
    save_model_folder(model, None, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(loaded) is recguide_hf.RecGuideForCausalLM
    assert loaded.generate.func is recguide_hf.generate


def test_mask_never_generated_plainly(model):
    torch.manual_seed(0)
    ids = torch.randint(4, 96, (16, 6))
    for kw in (dict(do_sample=False), dict(do_sample=True, temperature=2.0)):
        out = model.generate(ids, max_new_tokens=30, **kw)
        assert not (out[:, 6:] == MASK).any()


@pytest.mark.skipif(not os.path.exists(os.path.join(BUNDLED, "model.safetensors")), reason="bundled weights missing")
def test_bundled_folder_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(BUNDLED)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED, trust_remote_code=True)
    assert tok.mask_token_id == model.config.mask_token_id
    enc = tok(["def add(a, b):\n    return"], return_tensors="pt")
    ar = model.generate(**enc, max_new_tokens=12, recguide_mode="ar")
    fast = model.generate(**enc, max_new_tokens=12)
    assert torch.equal(ar, fast)
    assert not (ar == tok.mask_token_id).any()
