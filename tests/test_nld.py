"""NLD-style models (docs/algorithm.md §4) on a tiny random stand-in: per-token LoRA routing, parity, loading paths."""

import json

import pytest
import torch

pytest.importorskip("peft")

from conftest import assert_close_layouts, fused_forward, left_pad, random_prompts

import recguide_hf
from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.engine import Engine, SamplingSettings
from recguide_hf.models.nld import NLDBackbone
from recguide_hf.models.registry import as_backbone
from recguide_hf.testing.nld_standin import (
    EOS,
    LLAMA4_THRESHOLD,
    MASK,
    PAD,
    VOCAB,
    ar_greedy,
    linear_ss_reference,
    lora_layers,
    set_lora,
    standin,
    write_standin_folder,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls: extra threads only contend with whatever else runs on the machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return standin(seed=0)


def prompts_for(n, seed, max_len=12):
    """Random prompts without MASK or EOS in them."""
    prompts = random_prompts(n, VOCAB, min_len=1, max_len=max_len, seed=seed)
    return [[t if t not in (MASK, EOS) else t + 1 for t in p] for p in prompts]


def test_backbone_facts():
    model = standin(seed=0)
    assert all(layer.self_attn.diffusion_lm is True for layer in model.encoder.layers)  # as NLD loads
    bb = as_backbone(model)
    assert isinstance(bb, NLDBackbone)
    assert (bb.mask_token_id, bb.vocab_size, bb.max_positions) == (MASK, VOCAB, 1024)
    assert len(bb.lora_layers) == 2 and all(m.base_layer.in_features == 64 for m in bb.lora_layers)
    cache = bb.new_cache(3, 40)
    assert len(cache.keys) == 2 and cache.keys[0] is None  # made where and as each layer first writes
    cache.bind(torch.arange(3), 4)
    with torch.no_grad():
        bb.forward(torch.full((3, 4), 20), torch.arange(4).expand(3, -1), None, cache)
    assert cache.keys[0].shape == (3, 2, 40, 16)
    assert all(layer.self_attn.diffusion_lm is False for layer in model.encoder.layers)


@torch.no_grad()
def test_the_standin_behaves_like_nlds_files():
    """What the adapter must work around, checked on the stand-in itself (so it cannot quietly lose it): a 4D mask
    counts only with `use_causal_mask=True`; the llama-4 query scale follows `cache_position`; the mask builder
    is called with transformers 5.0's keyword names, a TypeError from 5.9 on."""
    import inspect
    import sys

    from transformers import masking_utils

    model = standin(seed=0, lora=False)
    model.set_diffusion_lm(False)
    enc = model.encoder
    ids = torch.tensor([[5, 17, 23, 40, 8, 70]])
    blocked = torch.zeros(1, 1, 6, 6)
    blocked[..., 1:] = float("-inf")  # every query sees token 0 only
    no_mask = enc(input_ids=ids).last_hidden_state
    assert torch.equal(enc(input_ids=ids, attention_mask=blocked).last_hidden_state, no_mask)  # dropped
    modern = "input_embeds" not in inspect.signature(masking_utils.create_causal_mask).parameters
    if modern:  # 5.0's keyword names: a TypeError for any mask the builder must build (the adapter's bridge aside)
        with pytest.raises(TypeError):
            enc(input_ids=ids, attention_mask=torch.ones(1, 6, dtype=torch.long), use_causal_mask=True)
    if not modern or getattr(sys.modules[type(enc).__module__].create_causal_mask, "_recguide_bridge", False):
        gated = enc(input_ids=ids, attention_mask=blocked, use_causal_mask=True).last_hidden_state
        assert not torch.allclose(gated, no_mask, atol=1e-3)  # a 4D mask behind the gate counts
    pos = torch.arange(6)[None]  # rotary positions fixed: only the query scale can move
    far = enc(input_ids=ids, position_ids=pos, cache_position=torch.arange(6) + 1000).last_hidden_state
    assert not torch.allclose(far, no_mask, atol=1e-3)
    below = enc(input_ids=ids, position_ids=pos, cache_position=torch.arange(6) + LLAMA4_THRESHOLD - 6)
    assert torch.equal(below.last_hidden_state, no_mask)  # every scale 1 below the threshold


def test_verifier_logits_exactly_the_base_model(model):
    """Per-token routing: with draft tokens in the same forward, verifier logits are bit-for-bit those of the
    model with the LoRA disabled, and draft logits are those of a separate LoRA-on draft forward."""
    bb = as_backbone(model)
    prompt = [5, 17, 23, 40, 8, 70]
    verify, branch = [70, 33, 44, 55], [66, MASK, MASK, MASK]
    v_routed, b_routed = fused_forward(bb, prompt, verify, branch, branch_start=2)
    v_off, b_off = fused_forward(bb, prompt, verify, branch, branch_start=2, draft_on=False)
    assert torch.equal(v_routed, v_off)  # exact: verifier tokens never see the LoRA
    base = standin(seed=0, lora=False)  # same base weights, no PEFT layers at all
    v_base, _ = fused_forward(as_backbone(base), prompt, verify, branch, branch_start=2)
    assert torch.equal(v_routed, v_base)
    assert not torch.allclose(b_routed, b_off, atol=1e-3)  # the LoRA does change the draft tokens
    # below, the references run other computation layouts (no mask, other query widths): equal to rounding
    with torch.no_grad():
        # the verifier segment alone, causal from an empty cache (SDPA's is_causal), NLD's flags off, LoRA off
        set_lora(model, False)
        model.set_diffusion_lm(False)
        full = model.diffusion_head(model.encoder(input_ids=torch.tensor([prompt + verify[1:]])).last_hidden_state)
        assert_close_layouts(v_routed, full[0, -len(verify):])
        # the branch as a next-round draft, as NLD drafts: prefix [prompt, d_1] committed causally (LoRA off),
        # then [c_p, MASK x 3] with PEFT's LoRA on, the diffusion_lm flags True and the cache read, not written
        from transformers import DynamicCache

        cache = DynamicCache()
        model.encoder(input_ids=torch.tensor([prompt + verify[1:2]]), past_key_values=cache, use_cache=True)
        set_lora(model, True)
        model.set_diffusion_lm(True)
        draft = model.diffusion_head(model.encoder(input_ids=torch.tensor([branch]), past_key_values=cache,
                                                   use_cache=False).last_hidden_state)
        set_lora(model, False)
    assert_close_layouts(b_routed, draft[0])
    assert [m._disable_adapters for m in lora_layers(model)] == [True] * 2  # as set_lora(False) left them


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "no-lora"])
@pytest.mark.parametrize("mode", ["linear", "recguide"])
def test_parity_with_ar_and_reference(model, mode, lora):
    """RecGuide greedy (batch 1 and a left-padded batch, several block sizes) == NLD's own `ar_generate` row by
    row (LoRA off) == the plain LinearSS reference, prompt by prompt. Prompts of 1-12 tokens and 20 new ones cross
    the stand-in's lowered llama-4 threshold (16) at different steps in different rows."""
    if not lora:
        model = standin(seed=0, lora=False)
    prompts = prompts_for(4, seed=1)
    ids, mask = left_pad(prompts, pad=PAD)
    ref = ar_greedy(model, ids, mask, 20)
    lengths = mask.sum(1)
    assert int(lengths.min()) < LLAMA4_THRESHOLD < int(lengths.max()) + 20  # rows cross it at different steps
    for block in (2, 5, 16):
        out = recguide_hf.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=20,
                                   recguide_block_size=block, recguide_mode=mode)
        assert torch.equal(out, ref), (mode, block)
        one = torch.tensor([prompts[0]])
        alone = recguide_hf.generate(model, input_ids=one, max_new_tokens=20, recguide_block_size=block,
                                     recguide_mode=mode)
        assert torch.equal(alone, ar_greedy(model, one, None, 20)), (mode, block)
    width = ids.shape[1]
    for i, prompt in enumerate(prompts[:2]):
        new, _ = linear_ss_reference(model, prompt, 8, 20)
        assert new == ref[i, width:width + len(new)].tolist()


def test_linear_rounds_match_reference(model):
    """Batch 1, LinearSS: the engine accepts exactly the reference's drafts round by round (so drafts are
    made with the LoRA on and bidirectional attention, from the same positions)."""
    compared = accepted = 0
    for prompt in prompts_for(3, seed=2):
        for block in (4, 8):
            _, ref_rounds = linear_ss_reference(model, prompt, block, 40, prefill_all=False)
            engine = Engine(as_backbone(model), DecodingConfig(mode="linear", block_size=block),
                            SamplingSettings(max_new_tokens=40, eos_token_ids=[EOS], pad_token_id=PAD))
            engine._allocate(1, len(prompt))
            engine.slots.stats.round_log = []
            engine._admit(torch.tensor([0]), torch.tensor([prompt]), torch.tensor([0]))
            while engine._step():
                pass
            mine = [n for _, _, n, k, _, _ in engine.slots.stats.round_log if k == block - 1]  # full-size rounds
            assert mine == ref_rounds[:len(mine)]
            compared += len(mine)
            accepted += sum(mine)
    assert compared > 20 and accepted > 0


def test_streams_layout_and_sampling_run(model):
    ids, mask = left_pad(prompts_for(3, seed=3), pad=PAD)
    ref = ar_greedy(model, ids, mask, 12)
    engine = Engine(as_backbone(model), DecodingConfig(block_size=5),
                    SamplingSettings(max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=PAD))
    engine.split_streams = True  # the two-forward layout, run one after the other on CPU
    seq, _ = engine.generate(ids, mask)
    assert torch.equal(seq, ref)
    torch.manual_seed(0)
    a = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.7,
                             top_k=20, top_p=0.9, recguide_block_size=4)
    torch.manual_seed(0)
    b = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.7,
                             top_k=20, top_p=0.9, recguide_block_size=4)
    assert torch.equal(a, b) and a.shape == (3, ids.shape[1] + 8) and not (a[:, ids.shape[1]:] == MASK).any()


def test_flags_forced_causal_and_restored_switches(model):
    model.encoder.layers[0].self_attn.diffusion_lm = True  # as NLD's own draft step leaves it
    set_lora(model, True)
    ids = torch.tensor([[5, 6, 7]])
    recguide_hf.generate(model, ids, max_new_tokens=4, recguide_block_size=3)
    assert model.encoder.layers[0].self_attn.diffusion_lm is False
    assert [m._disable_adapters for m in lora_layers(model)] == [False, False]  # the user's setting kept
    assert all(not m._forward_hooks for m in lora_layers(model))  # no hooks left behind
    set_lora(model, False)


def test_generation_mixin_variant_and_peft_wrapper():
    """An NLD class that is a GenerationMixin (with its own `generate`) goes through HF's generate; a PEFT
    `PeftModel` around an NLD model is unwrapped and routes its LoRA the same way."""
    from peft import get_peft_model
    from transformers import GenerationConfig, GenerationMixin

    from recguide_hf.testing.nld_standin import lora_config, randomize_lora
    from recguide_hf.testing.nld_standin_modeling import NLDStandInModel

    class WithGenerate(NLDStandInModel, GenerationMixin):
        def generate(self, *args, **kwargs):  # NLD's block-diffusion generate shadows HF's
            raise AssertionError("RecGuide must not call the model's own generate")

    ids, mask = left_pad(prompts_for(3, seed=4), pad=PAD)
    plain = standin(seed=5)
    ref = ar_greedy(plain, ids, mask, 10)
    torch.manual_seed(5)
    gm = WithGenerate(plain.config).eval()
    gm.load_state_dict(standin(seed=5, lora=False).state_dict())
    gm.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=PAD)
    out = recguide_hf.generate(gm, ids, attention_mask=mask, max_new_tokens=10, recguide_block_size=4)
    assert torch.equal(out, ref)
    wrapped = get_peft_model(standin(seed=5, lora=False), lora_config())
    randomize_lora(wrapped, 0.3, 6)  # the same LoRA weights standin(seed=5) got
    bb = as_backbone(wrapped)
    assert isinstance(bb, NLDBackbone) and len(bb.lora_layers) == 2
    out = recguide_hf.generate(wrapped, ids, attention_mask=mask, max_new_tokens=10, recguide_block_size=4,
                               return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)


def test_model_folder_and_cli(tmp_path, capsys):
    """`recguide generate --model DIR` on an NLD-style folder (AutoModel + trust_remote_code), and the folder's
    model + its PEFT adapter reproduce the in-memory stand-in."""
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    from recguide_hf.tools.cli import main

    path = write_standin_folder(tmp_path / "nld", seed=0)
    loaded = AutoModel.from_pretrained(path, trust_remote_code=True).eval()
    drafter = PeftModel.from_pretrained(loaded, path / "draft_lora").eval()
    ids, mask = left_pad(prompts_for(2, seed=5), pad=PAD)
    mine = recguide_hf.generate(drafter, ids, attention_mask=mask, max_new_tokens=10, recguide_block_size=4,
                                return_dict_in_generate=True)
    theirs = recguide_hf.generate(standin(seed=0), ids, attention_mask=mask, max_new_tokens=10,
                                  recguide_block_size=4, return_dict_in_generate=True)
    assert torch.equal(mine.sequences, theirs.sequences)
    assert mine.recguide_stats["accepted_drafts"] == theirs.recguide_stats["accepted_drafts"]
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--max-new-tokens", "12",
                 "--block-size", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < result["new_tokens"] <= 12 and result["block_sizes"] == {"4": result["rounds"]}
    # --adapter attaches the drafting LoRA: same text and the same accepted drafts as the Python route
    assert main(["generate", "--model", str(path), "--adapter", str(path / "draft_lora"), "--prompt", "def f(x):",
                 "--max-new-tokens", "12", "--block-size", "4", "--json"]) == 0
    with_lora = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(["def f(x):"], return_tensors="pt")
    ref = recguide_hf.generate(drafter, **enc, max_new_tokens=12, recguide_block_size=4, return_dict_in_generate=True)
    assert with_lora["text"] == tok.decode(ref.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert with_lora["text"] == result["text"]  # lossless either way: the verifier runs the base weights
    assert with_lora["accepted_drafts"] == ref.recguide_stats["accepted_drafts"]
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", str(path), "--adapter", str(tmp_path / "missing"), "--prompt", "x"])
    assert stop.value.code == 2 and "argument --adapter" in capsys.readouterr().err
    # a folder without a tokenizer (as NLD's model files alone): it says so, and token ids in, token ids out
    import shutil

    bare = tmp_path / "no_tokenizer"
    shutil.copytree(path, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", str(bare), "--prompt", "def f(x):"])
    assert stop.value.code == 2 and "--prompt-ids" in capsys.readouterr().err
    ids = tok("def f(x):")["input_ids"]
    assert main(["generate", "--model", str(bare), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens",
                 "12", "--block-size", "4", "--json"]) == 0
    from_ids = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert from_ids["text"] is None and from_ids["new_ids"] == result["new_ids"]


def test_direct_path_refuses_what_it_cannot_do(model):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="repetition_penalty"):
        recguide_hf.generate(model, ids, max_new_tokens=4, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="recguide_mode='ar'"):
        recguide_hf.generate(model, ids, max_new_tokens=4, recguide_mode="ar")


def test_mask_builders_bridged_once():
    """The adapter wraps the encoder module's mask builders once: a 4D mask comes back as given, anything else
    reaches the original (NLD's own methods are unchanged); a second adapter does not wrap them again."""
    import sys

    model = standin(seed=9, lora=False)
    module = sys.modules[type(model.encoder).__module__]
    NLDBackbone(model)
    bridged = module.create_causal_mask
    assert bridged._recguide_bridge
    NLDBackbone(standin(seed=10, lora=False))
    assert module.create_causal_mask is bridged
    mask = torch.zeros(1, 1, 3, 3)
    assert bridged(config=model.config, input_embeds=None, attention_mask=mask) is mask
    with pytest.raises(TypeError):
        bridged("not a config")  # passed on to transformers' own builder, which refuses it


def test_adapter_guards():
    m = standin(seed=7)
    m.encoder.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="4D attention masks"):
        NLDBackbone(m)
    m = standin(seed=7)
    for layer in lora_layers(m):
        layer.merge()
    with pytest.raises(ValueError, match="merged"):
        NLDBackbone(m)
    m = standin(seed=7, lora=False, dlm_paradigm="block_diff")  # NLD's flex-attention class: reads no mask
    with pytest.raises(NotImplementedError, match="flex attention"):
        NLDBackbone(m)
    m.config.dlm_paradigm = "bidirectional"  # refused by what the layers are, whatever the config says now
    with pytest.raises(NotImplementedError, match="NLDStandInFlexAttention"):
        NLDBackbone(m)
    m = standin(seed=7, lora=False)
    m.config.dlm_type = "dream"
    with pytest.raises(NotImplementedError, match="dream"):
        NLDBackbone(m)
