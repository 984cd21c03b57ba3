"""The drafting adapter on this project's model class: per-token routing, the folder's `draft_lora/`, parity."""

import pytest
import torch
from conftest import MASK, PAD, fused_forward, left_pad, random_prompts, tiny_model

pytest.importorskip("peft")

import recguide_hf
from recguide_hf.models.draft_adapter import (
    ADAPTER_DIR,
    add_draft_adapter,
    input_groups,
    route,
    save_draft_adapter,
)
from recguide_hf.models.export import save_model_folder
from recguide_hf.models.registry import as_backbone

TARGETS = ["q_proj", "o_proj", "down_proj"]
EVERY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the bundled model's


def with_adapter(seed: int = 0, targets=TARGETS):
    """A tiny model plus a LoRA whose B is random (a fresh LoRA is the identity, which would prove nothing)."""
    model = tiny_model(seed)
    add_draft_adapter(model, rank=4, alpha=8, target_modules=targets)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A model folder as the bundled one is laid out: weights, code shims, and `draft_lora/`."""
    directory = tmp_path_factory.mktemp("with_adapter")
    save_model_folder(tiny_model(0), None, directory, recguide_block_size=4)
    save_draft_adapter(with_adapter(0), directory / ADAPTER_DIR)
    return directory


def test_fresh_adapter_is_the_identity_and_the_base_is_frozen():
    model = tiny_model(0)
    ids = torch.tensor([[5, 9, 17, 30, 41]])
    with torch.no_grad():
        base = model(ids).logits
        adapter = add_draft_adapter(model, rank=4, alpha=8, target_modules=TARGETS)
        assert len(adapter.names) == 2 * len(TARGETS)  # two decoder layers
        with route(adapter, 0):
            assert torch.equal(model(ids).logits, base)  # B = 0 at init
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("draft_adapter.lora_") for n in trainable)


def test_folder_attaches_adapter_and_plain_forward_is_the_verifier(folder):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert len(loaded.draft_adapter.names) == 2 * len(TARGETS)
    bare = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, draft_adapter=False)
    assert getattr(bare, "draft_adapter", None) is None
    ids = torch.tensor([[5, 9, 17, 30, 41]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, bare(ids).logits)  # no adapter outside the engine's draft tokens
        with route(loaded.draft_adapter, 0):
            on = loaded(ids).logits
        assert torch.equal(loaded(ids).logits, bare(ids).logits)  # and nothing left behind
    assert not torch.allclose(on, bare(ids).logits, atol=1e-3)
    # the weights are the ones saved, and the folder is a PEFT adapter folder PEFT itself can load
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(tiny_model(0), folder / ADAPTER_DIR)
    with torch.no_grad():
        assert torch.allclose(peft_model(ids).logits, on, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("suffix", [False, True], ids=["bool-mask", "column-suffix"])
def test_fused_forward_routes_per_token(folder, suffix):
    """Verifier tokens: bit-for-bit the base weights' logits even beside draft tokens; draft tokens: the LoRA's.
    Both forms of a mixed forward's draft tokens: a bool mask, and the engine's `draft_mask=Q` (columns Q..)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    bare = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, draft_adapter=False)
    prompt, verify, branch = [5, 17, 23, 40, 8, 70], [70, 33, 44, 55], [66, MASK, MASK, MASK]
    v_routed, b_routed = fused_forward(as_backbone(loaded), prompt, verify, branch, 2, suffix=suffix)
    v_base, b_base = fused_forward(as_backbone(bare), prompt, verify, branch, 2)
    assert torch.equal(v_routed, v_base)
    assert not torch.allclose(b_routed, b_base, atol=1e-3)
    assert all(not m._forward_hooks for m in loaded.modules())  # no hook left behind
    # the branch equals a separate draft forward: prefix [prompt, d_1] committed causally with the LoRA off,
    # then [c_p, MASK x 3] bidirectionally with the whole LoRA on
    from transformers import DynamicCache

    cache = DynamicCache(config=loaded.config)
    loaded(input_ids=torch.tensor([prompt + verify[1:2]]), cache=cache, use_cache=True)
    p = cache.get_seq_length()
    with route(loaded.draft_adapter, 0):
        draft = loaded(input_ids=torch.tensor([branch]), position_ids=torch.arange(p, p + 4)[None], cache=cache,
                       attention_mask=torch.zeros(1, 1, 4, p + 4), use_cache=True).logits
    torch.testing.assert_close(b_routed, draft[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "recguide"])
def test_greedy_parity_with_adapter(folder, mode):
    """Whatever the drafter proposes, greedy output equals plain HF greedy of the verifier."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    ids, mask = left_pad(random_prompts(4, 96, seed=3), pad=PAD)
    ref = loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, recguide_mode="ar",
                          do_sample=False)
    for block in (3, 8):
        out = loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, recguide_mode=mode,
                              recguide_block_size=block)
        assert torch.equal(out, ref), (mode, block)
    stats = recguide_hf.generate(loaded, input_ids=ids, attention_mask=mask, max_new_tokens=24, recguide_mode=mode,
                                 recguide_block_size=8, return_dict_in_generate=True).recguide_stats
    assert stats["rounds"] > 0


@torch.no_grad()
def test_draft_forward_on_merged_weights_equals_the_hooks_and_restores_the_base(folder):
    """A draft forward (every token drafts) runs on W + s B A; that equals the per-token hooks up to rounding, the
    base weights are never touched, and after it the model's forward is the base model's again, bit for bit."""
    from transformers import AutoModelForCausalLM

    from recguide_hf.models.draft_adapter import route

    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    before = {n: p.clone() for n, p in loaded.named_parameters()}
    ids = torch.tensor([[5, 9, 17, 30, 41, 7]])
    base = loaded(ids).logits
    with route(loaded.draft_adapter, 0):  # merged weights
        merged = loaded(ids).logits
    with route(loaded.draft_adapter, torch.ones(1, 6, dtype=torch.bool)):  # hooks on every token
        hooked = loaded(ids).logits
    torch.testing.assert_close(merged, hooked, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(merged, base, atol=1e-3)  # the merged weights did run
    assert all(torch.equal(p, before[n]) for n, p in loaded.named_parameters())
    assert all("forward" not in m.__dict__ for m in loaded.modules())  # the merged-weight forwards are gone
    torch.testing.assert_close(loaded(ids).logits, base, atol=0, rtol=0)  # and a plain forward is the base model's
    loaded.draft_adapter.requires_grad_(True)  # while training, gradients must reach A and B: hooks, not merges
    assert loaded.draft_adapter.merged_weights() is None


@pytest.mark.parametrize("targets", [TARGETS, EVERY_LINEAR], ids=["ungrouped", "every-linear"])
def test_column_suffix_routing_with_gradients(targets):
    """`draft_mask=k` under autograd (no in-place add): the same logits as the bool mask of columns k.., the
    columns before k exactly the base model's, and gradients reach the adapter. With every linear adapted, q/k/v
    and gate/up share one `A` product per input (`input_groups`); the hooks compute each layer's own."""
    model = with_adapter(0, targets)
    adapter = model.draft_adapter
    adapter.requires_grad_(True)
    ids = torch.tensor([[5, 9, 17, 30, 41, 7], [8, 12, 60, 3, 19, 22]])
    with torch.no_grad():
        base = model(ids).logits
    with route(adapter, torch.arange(6).expand(2, -1) >= 3):
        masked = model(ids).logits
    with route(adapter, 3):
        suffix = model(ids).logits
    # rounding only (GEMM blocking differs with thread count and product width: up to ~1e-5 seen with every linear
    # adapted); the draft columns' deltas are O(1-10) here, so a misrouted product would be far outside
    torch.testing.assert_close(suffix, masked, atol=1e-4, rtol=1e-4)
    assert torch.equal(suffix[:, :3], base[:, :3])  # causal: the earlier columns never see a draft token
    assert not torch.allclose(suffix[:, 3:], base[:, 3:], atol=1e-3)
    suffix[:, 3:].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.parameters())
    assert all("forward" not in m.__dict__ and not m._forward_hooks for m in model.modules())  # nothing stays
    with torch.no_grad(), route(adapter, 3):  # the in-place form gives the same logits (up to rounding: autograd
        # takes another GEMM path for a group's shared product, ~1e-5; without groups they agree to 1e-6)
        torch.testing.assert_close(model(ids).logits, suffix.detach(), atol=1e-4, rtol=1e-4)


def test_input_groups_join_siblings_that_read_one_input():
    names = ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
             "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj",
             "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert input_groups(names) == [[0], [1, 2], [3, 5, 6], [4], [7, 8]]
    assert input_groups(["a.o_proj", "b.o_proj"]) == [[0], [1]]


@torch.no_grad()
def test_shared_a_product_is_recomputed_for_another_input():
    """A group member called on a tensor other than the one its group's product was computed on computes its own:
    each adapted layer's output is `W x` plus its own delta on columns 2.. whatever order and inputs it gets."""
    import torch.nn.functional as F

    model = with_adapter(0, EVERY_LINEAR)
    adapter = model.draft_adapter
    attention = model.model.layers[0].self_attn
    layers = {"q": attention.q_proj, "k": attention.k_proj, "v": attention.v_proj}
    own = {m: (a, b, s) for m, a, b, s in adapter.entries()}
    x1, x2 = torch.randn(2, 5, attention.q_proj.in_features).unbind(0)
    calls = [("q", x1), ("k", x2), ("v", x1), ("k", x1), ("q", x2)]
    with route(adapter, 2):
        outs = [layers[n](x[None].clone() if i == 1 else x[None]) for i, (n, x) in enumerate(calls)]
    for (n, x), y in zip(calls, outs):
        m = layers[n]
        a, b, s = own[m]
        expected = F.linear(x[None], m.weight, m.bias)
        expected[:, 2:] += s * F.linear(F.linear(x[None, 2:], a), b)
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@torch.no_grad()
def test_compiled_mixed_forward_routes_like_eager():
    """Under torch.compile (`recguide_compile`'s mixed forward traces `route`), a fused verify + branch forward with
    every linear adapted (so q/k/v and gate/up share their `A` product) gives the eager forward's logits."""
    import torch._dynamo

    torch._dynamo.reset()
    model = with_adapter(0, EVERY_LINEAR)
    model.draft_adapter.requires_grad_(False)
    bb = as_backbone(model)
    prompt, verify, branch = [5, 17, 23, 40, 8, 70], [70, 33, 44, 55], [66, MASK, MASK, MASK]
    eager = fused_forward(bb, prompt, verify, branch, 2, suffix=True)
    bb.forward = torch.compile(type(bb).forward.__get__(bb), dynamic=True)
    try:
        compiled = fused_forward(bb, prompt, verify, branch, 2, suffix=True)
    finally:
        del bb.forward
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(eager[1], fused_forward(bb, prompt, verify, branch, 2, draft_on=False, suffix=True)[1],
                              atol=1e-3)  # the branch really was routed
