"""RowCache bookkeeping and mask construction against a brute-force reference."""

import torch

from recguide_hf.core.masks import build_mask, causal_intra, positions
from recguide_hf.models.cache import RowCache


def test_rollback_is_not_advancing():
    cache = RowCache(num_layers=1, num_rows=2, capacity=16)
    rows = torch.tensor([0, 1])
    cache.bind(rows, 3)
    k = torch.arange(6, dtype=torch.float).view(2, 1, 3, 1)
    keys, _ = cache.update(k, k, 0)
    assert keys.shape == (2, 1, 3, 1)
    cache.commit(rows, torch.tensor([1, 3]))
    assert cache.lengths.tolist() == [1, 3]
    # next forward writes right after each committed length, overwriting the uncommitted slots
    cache.bind(torch.tensor([0]), 2)
    k2 = torch.tensor([10.0, 11.0]).view(1, 1, 2, 1)
    keys, _ = cache.update(k2, k2, 0)
    assert keys[0, 0, :, 0].tolist() == [0.0, 10.0, 11.0]
    assert cache.keys[0][1, 0, :3, 0].tolist() == [3.0, 4.0, 5.0]  # row 1 untouched


def test_shared_start_writes_one_slice_like_the_scatter():
    """Rows of one committed length write a slice; the result equals the per-row scatter's."""
    g = torch.Generator().manual_seed(0)
    fast, slow = (RowCache(num_layers=1, num_rows=3, capacity=12) for _ in range(2))
    for cache in (fast, slow):
        cache.lengths[:] = 5
    rows = torch.arange(3)
    k, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    fast.bind(rows, 4)
    assert fast._binding.start == 5
    slow.bind(rows, 4)
    slow._binding.start = None  # force the scatter
    out_fast, out_slow = fast.update(k, v, 0), slow.update(k, v, 0)
    assert all(torch.equal(a, b) for a, b in zip(out_fast, out_slow))
    assert fast.zeroed == slow.zeroed == 9  # the slots a forward has reached: zeroed or written, never garbage
    assert torch.equal(fast.keys[0][:, :, :9], slow.keys[0][:, :, :9])
    assert torch.equal(fast.values[0][:, :, :9], slow.values[0][:, :, :9])
    assert not fast.keys[0][:, :, :5].any()  # read (masked) by the forward, never written: zeros
    assert torch.equal(fast.keys[0][:, :, 5:9], k)
    fast.lengths[1] = 6
    fast.bind(rows, 2)
    assert fast._binding.start is None  # lengths differ: scatter
    fast.bind(torch.tensor([0, 2]), 2)
    assert fast._binding.start is None  # a subset of the rows: scatter


def test_build_mask_brute_force():
    lengths, pads = torch.tensor([4, 2]), torch.tensor([1, 0])
    q = 3
    intra = causal_intra(2, q)
    kv = int(lengths.max()) + q
    mask = build_mask(lengths, pads, intra, kv)
    for r in range(2):
        for i in range(q):
            for j in range(kv):
                prefix = pads[r] <= j < lengths[r]
                new = lengths[r] <= j < lengths[r] + q and (j - lengths[r]) <= i
                allowed = bool(prefix or new)
                assert (mask[r, 0, i, j] == 0) == allowed, (r, i, j)
    assert positions(lengths, pads, torch.arange(q)).tolist() == [[3, 4, 5], [2, 3, 4]]


def test_length_groups_bound_the_padding():
    from recguide_hf.core.masks import length_groups

    # longest first; 318 x 3 = 954 <= 1.25 x (318 + 300 + 149) = 958.75, a fourth row would pad past it
    assert length_groups([149, 318, 100, 300, 50, 60, 61, 10]) == [[1, 3, 0], [2, 6], [5, 4], [7]]
    assert length_groups([5, 5, 5]) == [[0, 1, 2]]
    assert length_groups([8, 1], waste=0.0) == [[0], [1]]
    assert length_groups([]) == []


def test_fresh_rows_attend_over_what_they_write():
    """A forward whose rows all start empty (a prefill) gets back its own keys/values, and the buffers hold
    them at the rows' first slots, as the general scatter path would have written them."""
    cache = RowCache(num_layers=1, num_rows=4, capacity=10)
    cache.lengths[:] = torch.tensor([5, 0, 2, 0])
    rows = torch.tensor([3, 1])
    cache.bind(rows, 4)
    assert cache._binding.fresh
    k, v = torch.randn(2, 2, 4, 3), torch.randn(2, 2, 4, 3)
    seen_k, seen_v = cache.update(k, v, 0)
    assert seen_k is k and seen_v is v
    assert torch.equal(cache.keys[0][rows, :, :4], k) and torch.equal(cache.values[0][rows, :, :4], v)
    cache.bind(torch.tensor([1, 2]), 4)  # row 2 has a prefix: the general path
    assert not cache._binding.fresh


def _prefilled_engine(model, prompts, in_place: bool):
    """An engine whose rows hold `prompts` (prefilled), its cache reading subsets in place or gathering them."""
    from conftest import left_pad

    from recguide_hf.core.config import DecodingConfig
    from recguide_hf.core.engine import Engine, SamplingSettings
    from recguide_hf.models.registry import as_backbone

    ids, mask = left_pad(prompts)
    engine = Engine(as_backbone(model), DecodingConfig(mode="linear", block_size=4), SamplingSettings(max_new_tokens=4))
    engine._allocate(*ids.shape)
    engine._admit(torch.arange(ids.shape[0]), ids, (mask == 0).sum(1))
    assert engine.slots.cache.row_runs  # an SDPA model: on by default
    engine.slots.cache.row_runs = in_place
    return engine


def test_a_forward_over_some_rows_reads_them_in_place(monkeypatch):
    """A forward over some of the cache's rows (one bucket, or the rows still running) attends over the
    buffers in place, one SDPA call per run of consecutive slots: the same logits as attending over a gathered
    copy of those rows, with no copy (it once cost a copy of their context per layer and forward)."""
    from conftest import assert_close_layouts, random_prompts, tiny_model

    from recguide_hf.models import attention

    model = tiny_model(seed=3)
    prompts = random_prompts(6, 96, min_len=2, max_len=12, seed=4)
    subset = torch.tensor([0, 1, 3, 4, 5])
    query = torch.randint(4, 96, (5, 3), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(attention, "RUN_OVERHEAD", 10 ** 6)  # runs by contiguity alone (widths: the next test)
    calls = []
    sdpa = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda m, q, *a, **k: calls.append(q.shape[0])
                        or sdpa(m, q, *a, **k))
    logits = {}
    for in_place in (True, False):
        engine = _prefilled_engine(model, prompts, in_place)
        binding = engine.slots.cache.prepare(subset, 3)
        widths = (engine.slots.cache.lengths + 3).tolist()  # per slot: its committed length + the 3 query tokens
        expected = [(0, 0, 2, max(widths[0:2])), (2, 3, 3, max(widths[3:6]))] if in_place else None
        assert binding.runs == expected
        calls.clear()
        logits[in_place] = engine._forward(subset, query, torch.arange(3).expand(5, -1), causal_intra(5, 3))
        layers = model.config.num_hidden_layers
        assert calls == ([2, 3] * layers if in_place else [])  # else HF's own SDPA path, over a copy
        engine.slots.cache.use(binding)
        keys, _ = engine.slots.cache.update(torch.zeros(5, 2, 3, 16), torch.zeros(5, 2, 3, 16), 0)
        assert (keys.data_ptr() == engine.slots.cache.keys[0].data_ptr()) == in_place  # a view of the buffer, or a copy
    # SDPA per run of slots vs one call over a gathered copy: different kernels and summation orders, so equal to
    # rounding, not bit for bit (issue 31: bit-equal on one machine, not on another)
    assert_close_layouts(logits[True], logits[False])
    assert model.config._attn_implementation == "sdpa"  # restored after the engine's forwards


def test_runs_end_where_rows_need_much_shorter_or_longer_keys():
    """Known answers for `attention.row_runs`: runs of consecutive slots, split again where a row's key width
    differs from its run's by more padding than one more attention call costs (`RUN_OVERHEAD` slots)."""
    from recguide_hf.models import attention

    o = attention.RUN_OVERHEAD
    assert attention.row_runs([0, 1, 2, 5], [10, 10, 10, 10]) == [(0, 0, 3, 10), (3, 5, 1, 10)]
    assert attention.row_runs([2, 1], [10, 10]) is None  # not ascending: the forward gathers instead
    # a much shorter row starts a run of its own; one a little shorter joins (and reads a little padding)
    assert attention.row_runs([0, 1, 2], [400, 400 - o - 1, 400 - o]) == [(0, 0, 1, 400), (1, 1, 2, 400 - o)]
    assert attention.row_runs([0, 1], [400, 400 - o]) == [(0, 0, 2, 400)]
    # a longer row joins only while the run's rows together read little more
    assert attention.row_runs([0, 1, 2], [100, 100, 100 + o // 2]) == [(0, 0, 3, 100 + o // 2)]
    assert attention.row_runs([0, 1, 2], [100, 100, 100 + o]) == [(0, 0, 2, 100), (2, 2, 1, 100 + o)]


def test_an_all_rows_forward_reads_each_run_only_as_far_as_it_needs(monkeypatch):
    """Rows of very different lengths in one forward: each run of similar rows attends over its own key width,
    and the logits match one SDPA call over every row's keys up to the longest."""
    from conftest import random_prompts, tiny_model

    from recguide_hf.models import attention

    model = tiny_model(seed=5)
    lengths = [60, 58, 3, 2, 40]
    prompts = [p[:n] for p, n in zip(random_prompts(5, 96, min_len=60, max_len=61, seed=6), lengths)]
    monkeypatch.setattr(attention, "RUN_OVERHEAD", 10)
    query = torch.randint(4, 96, (5, 2), generator=torch.Generator().manual_seed(2))
    logits = {}
    for split in (True, False):
        engine = _prefilled_engine(model, prompts, split)
        binding = engine.slots.cache.prepare(torch.arange(5), 2)
        # prefill keeps all but the seed: committed 59, 57, 2, 1, 39 slots, + 2 query tokens
        assert binding.runs == ([(0, 0, 2, 61), (2, 2, 2, 4), (4, 4, 1, 41)] if split else None)
        logits[split] = engine._forward(torch.arange(5), query, torch.arange(2).expand(5, -1), causal_intra(5, 2))
    assert torch.allclose(logits[True], logits[False], atol=1e-5)
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))


def test_the_runs_op_attends_as_the_traced_runs_do():
    """`recguide::row_runs_sdpa` (what a compiled forward calls; it reads the runs `set_runs` set when it runs) gives
    the traced runs' output bit for bit, for a subset of the cache's rows, with and without a mask; torch's op
    checker accepts its fake (shape-only) implementation, which is what a compiled graph is built from."""
    from conftest import tiny_model

    from recguide_hf.models import attention

    model = tiny_model(seed=3)
    layer = next(m for m in model.modules() if hasattr(m, "layer_idx"))
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    query = torch.randn(3, heads, 2, dim, generator=g)
    key, value = (torch.randn(6, kv_heads, 20, dim, generator=g) for _ in range(2))  # 6 cache rows, 20 slots
    runs = [(0, 1, 2, 17), (2, 4, 1, 9)]  # query rows 0-1 are cache rows 1-2 (17 keys); row 2 is cache row 4
    mask = torch.zeros(3, 1, 2, 20)
    mask[..., 15:] = float("-inf")
    attention.set_runs(runs)
    try:
        for m in (mask, None):
            traced = attention._attend_runs(layer, query, key, value, m, runs, dropout=0.0, scaling=layer.scaling)
            args = (query, key, value, m, layer.num_key_value_groups, True, 0.0, layer.scaling)
            op = torch.ops.recguide.row_runs_sdpa(*args)
            assert op.shape == (3, 2, heads, dim) and torch.equal(op, traced)
            torch.library.opcheck(attention.row_runs_sdpa, args, test_utils=("test_schema", "test_faketensor"))
    finally:
        attention.set_runs(None)


def test_a_compiled_attention_reads_new_runs_without_a_new_graph():
    """Under torch.compile the runs reach attention only through the op, read when it runs: three layouts of rows
    (one run, two runs, two runs over other slots) give the eager runs' output and compile one graph."""
    import torch._dynamo
    from conftest import tiny_model
    from torch._dynamo.utils import counters

    from recguide_hf.models import attention

    torch._dynamo.reset()
    model = tiny_model(seed=3)
    layer = next(m for m in model.modules() if hasattr(m, "layer_idx"))
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    query = torch.randn(2, heads, 3, dim, generator=g)
    key, value = (torch.randn(5, kv_heads, 24, dim, generator=g) for _ in range(2))
    mask = torch.zeros(2, 1, 3, 24)

    def attend(q, k, v, m):
        return attention.row_runs_attention(layer, q, k, v, m, dropout=0.0, scaling=layer.scaling)[0]

    compiled = torch.compile(attend, dynamic=True, backend="aot_eager")  # the graph logic, without code generation
    base = counters["stats"]["unique_graphs"]
    try:
        for runs in ([(0, 0, 2, 24)], [(0, 0, 1, 20), (1, 1, 1, 24)], [(0, 2, 1, 10), (1, 4, 1, 24)]):
            attention.set_runs(runs)
            assert torch.equal(compiled(query, key, value, mask), attend(query, key, value, mask)), runs
            assert counters["stats"]["unique_graphs"] == base + 1, runs
    finally:
        attention.set_runs(None)
