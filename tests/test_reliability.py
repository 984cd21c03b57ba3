"""Edge cases behave like plain `generate`; properties over random inputs; memory stays bounded."""

import gc
import json
from pathlib import Path

import psutil
import pytest
import torch
from conftest import EOS, MASK, PAD, left_pad, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import recguide_hf
from recguide_hf import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = BUNDLED_MODEL



def hf(model, ids, mask=None, **kw):
    if mask is not None:  # transformers 5.0's generate fails on an explicit attention_mask=None
        kw["attention_mask"] = mask
    return model.generate(ids, do_sample=False, **kw)


def test_max_new_tokens_zero_and_one(model):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        recguide_hf.generate(model, ids, max_new_tokens=0)
    assert torch.equal(recguide_hf.generate(model, ids, max_new_tokens=1), hf(model, ids, max_new_tokens=1))


def test_prompt_ending_in_eos_and_containing_mask(model):
    # EOS at the end of a prompt does not stop generation (as in HF); a MASK inside a prompt is an ordinary
    # token to attend to (only drafted positions are MASK queries), so output equals HF greedy
    for prompt in ([5, 6, EOS], [5, MASK, 7, 8], [MASK]):
        ids = torch.tensor([prompt])
        assert torch.equal(recguide_hf.generate(model, ids, max_new_tokens=10), hf(model, ids, max_new_tokens=10))


def test_pad_equals_eos(model):
    ids, mask = left_pad([[5, 6, 7, 8, 9], [10, 11]], pad=EOS)
    kw = dict(max_new_tokens=12, pad_token_id=EOS, eos_token_id=EOS)
    assert torch.equal(recguide_hf.generate(model, ids, attention_mask=mask, **kw), hf(model, ids, mask, **kw))


def test_empty_prompt_and_too_long_prompt_raise(model):
    with pytest.raises(ValueError, match="at least one token"):
        recguide_hf.generate(model, torch.tensor([[PAD, PAD]]), attention_mask=torch.zeros(1, 2, dtype=torch.long),
                             max_new_tokens=3)
    with pytest.raises(ValueError, match="maximum positions"):
        recguide_hf.generate(model, torch.randint(4, 90, (1, 510)), max_new_tokens=10)


@pytest.mark.skipif(not (BUNDLED / "tokenizer.json").exists(), reason="bundled tokenizer missing")
def test_stop_strings(tmp_path):
    tok = AutoTokenizer.from_pretrained(BUNDLED)
    model = tiny_model(seed=4, vocab=len(tok))
    model.config.mask_token_id = tok.mask_token_id
    model.generation_config.suppress_tokens = [tok.mask_token_id]
    enc = tok(["def f(x):\n    return", "class A:\n"], return_tensors="pt", padding=True)
    free = hf(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=16)
    text = tok.decode(free[0, enc["input_ids"].shape[1]:][4:6])  # a string row 0 will produce
    kw = dict(max_new_tokens=16, stop_strings=[text], tokenizer=tok)
    ref = hf(model, enc["input_ids"], enc["attention_mask"], **kw)
    out = recguide_hf.generate(model, **enc, recguide_block_size=6, **kw)
    assert torch.equal(out, ref)


prompt_lists = st.lists(st.lists(st.integers(4, 95), min_size=1, max_size=16), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=prompt_lists, block=st.integers(2, 12), mode=st.sampled_from(["linear", "recguide"]),
       max_new=st.integers(1, 14))
def test_property_parity_with_hf_greedy(model, prompts, block, mode, max_new):
    ids, mask = left_pad(prompts)
    out = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=max_new, recguide_mode=mode,
                               recguide_block_size=block)
    assert torch.equal(out, hf(model, ids, mask, max_new_tokens=max_new))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=prompt_lists, pick=st.integers(0, 4), block=st.integers(2, 10))
def test_property_same_output_alone_and_in_any_batch(model, prompts, pick, block):
    pick %= len(prompts)
    ids, mask = left_pad(prompts)
    batched = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=10, recguide_block_size=block)
    alone = recguide_hf.generate(model, torch.tensor([prompts[pick]]), max_new_tokens=10, recguide_block_size=block)
    new_alone = alone[0, len(prompts[pick]):]
    assert torch.equal(batched[pick, ids.shape[1]:ids.shape[1] + new_alone.numel()], new_alone)


def _tensor_count():
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_repeated_calls_do_not_grow_memory(model):
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]])
    for _ in range(3):  # warm-up
        recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=20)
    gc.collect()
    tensors, rss = _tensor_count(), psutil.Process().memory_info().rss
    for _ in range(40):
        recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=20)
    gc.collect()
    assert _tensor_count() <= tensors + 5
    assert psutil.Process().memory_info().rss - rss < 50 * 2**20


def test_cache_is_bounded():
    from recguide_hf.core.config import DecodingConfig
    from recguide_hf.core.engine import Engine, SamplingSettings
    from recguide_hf.models.hf_backbone import HFBackbone as Backbone

    model = tiny_model(seed=1)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11]])
    engine = Engine(Backbone(model), DecodingConfig(block_size=8), SamplingSettings(max_new_tokens=30))
    engine.generate(ids, mask)
    # batch x (longest prompt + max_new_tokens + widest round: the block plus three branch segments and a
    # verifier copy for the two-stream layout)
    assert engine.slots.cache.keys[0].shape[0] == 2
    assert engine.slots.cache.capacity == 6 + 30 + 8 + 4 * 8


@pytest.mark.slow
def test_long_generation_constant_round_cost():
    from recguide_hf.core.config import DecodingConfig
    from recguide_hf.core.engine import Engine, SamplingSettings
    from recguide_hf.models.hf_backbone import HFBackbone as Backbone

    model = tiny_model(seed=2)
    model.config.max_position_embeddings = 4096
    model.generation_config.eos_token_id = None
    backbone = Backbone(model)
    allocations = []
    make_cache = backbone.new_cache
    backbone.new_cache = lambda *a: allocations.append(a) or make_cache(*a)
    engine = Engine(backbone, DecodingConfig(mode="linear", block_size=8), SamplingSettings(max_new_tokens=2000))
    seq, stats = engine.generate(torch.tensor([[5, 6, 7]]))
    s = stats.as_dict()
    assert s["new_tokens"] == 2000 and len(allocations) == 1  # one preallocated cache, never regrown
    # every round feeds the same query tokens (draft + verify of B) however long the sequence already is
    assert s["query_tokens"] <= 2 * 8 * s["rounds"]
    ref = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2000, do_sample=False)
    assert torch.equal(seq, ref)


@pytest.mark.skipif(not (BUNDLED / "model.safetensors").exists(), reason="bundled weights missing")
def test_lm_eval_stateful_stop_criteria_match_hf():
    """lm-eval's MultiTokenEOSCriteria is stateful per row and reads `input_ids[:, W:]`: rows that advance by
    different amounts in a round must each be shown to it as HF's loop would show them. A misaligned view once
    let prompt text (with its line breaks) into the window and cut responses short."""
    lm_utils = pytest.importorskip("lm_eval.models.utils_hf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED, trust_remote_code=True, dtype=torch.float32).eval()
    docs = [json.loads(x)["prompt"] for x in (ROOT / "eval" / "tasks" / "data" / "shakespeare_nextline.jsonl").open()]
    docs = sorted(docs[:16], key=lambda p: -len(tok(p)["input_ids"]))  # lm-eval batches longest first

    def responses(batch_prompts, mode):
        batch = tok(batch_prompts, return_tensors="pt", padding=True)
        width = batch["input_ids"].shape[1]
        crit = lm_utils.stop_sequences_criteria(tok, ["\n"], width, len(batch_prompts))
        out = model.generate(**batch, max_new_tokens=32, do_sample=False, stopping_criteria=crit,
                             recguide_mode=mode, recguide_block_size=8)
        new = [[t for t in row if t != tok.pad_token_id] for row in out[:, width:].tolist()]
        texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        return [t.split("\n")[0] for t in texts], new  # lm-eval cuts every response at the stop sequence

    ref, ours = [], []
    for i in range(0, len(docs), 4):
        (ref_text, ref_ids), (our_text, our_ids) = responses(docs[i:i + 4], "ar"), responses(docs[i:i + 4], "recguide")
        ref += ref_text
        ours += our_text
        # the criterion's "all rows done" ends the whole batch, as it ends HF's loop: no row runs on to
        # max_new_tokens (it once stopped only the row it was judging, and every other row ran to 32 tokens);
        # a row ends within one block of HF's common length, and agrees with HF token for token up to there
        assert all(o[:len(r)] == r[:len(o)] for o, r in zip(our_ids, ref_ids))
        assert max(len(o) for o in our_ids) <= max(len(r) for r in ref_ids) + 7 < 32
    assert ref == ours
    assert sum(len(r) > 0 for r in ref) >= 6  # enough rows say something before their line break
