"""A KV cache with one committed length per request row.

Rollback is simply not advancing a row's length: a forward writes its query tokens' keys/values into the
slots right after each row's committed length (scratch space), and only `commit` makes slots permanent.
The next forward overwrites whatever was not committed, so no masked holes accumulate and nothing is
copied per step. Which slots a query may see is the caller's 4D mask (see `masks.py`).

The cache is a `transformers.Cache` subclass: HF attention layers call `update(k, v, layer_idx)` and
attend over what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import Cache

from .attention import row_runs, set_runs


@dataclass
class Binding:
    """Where one forward's query tokens go: rows [R], slots [R, Q], the KV width it sees."""

    rows: torch.Tensor
    write_pos: torch.Tensor
    kv_len: int
    all_rows: bool
    start: int | None = None  # the one first write slot when every row of an all-rows forward shares it
    fresh: bool = False  # every row starts empty (a prefill): it sees exactly the keys/values it writes
    # runs of slots read in place, each over the key width its rows need (attention.py); None: one SDPA call
    runs: list[tuple[int, int, int, int]] | None = None
    # whether `runs` is set, as a bool: what a compiled forward's cache code reads (a guard on the list itself
    # could tie a graph to the number of runs)
    in_runs: bool = False
    # (rows, write_pos) copied to the other devices layers of a split model run on: once per device and forward
    elsewhere: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` and `write_pos` on `device` (a layer of a model split over devices: accelerate's device map)."""
        if device == self.rows.device:
            return self.rows, self.write_pos
        if device not in self.elsewhere:
            self.elsewhere[device] = (self.rows.to(device), self.write_pos.to(device))
        return self.elsewhere[device]


class RowCache(Cache):
    """Per-layer key/value buffers `[rows, kv_heads, capacity, head_dim]`, each made where its layer runs.

    Args:
        num_layers: decoder layers (each gets its buffers at its first write).
        num_rows: request rows.
        capacity: slots per row: it bounds longest prompt + new tokens + the widest query of a round.
        device: where the per-forward bookkeeping (rows, write slots) is made: the device the model takes its
            inputs on.

    A layer's buffers are made when it first writes, from the key/value states it writes: their device (a model
    split by accelerate's device map runs layers on several devices, or loads offloaded layers onto an execution
    device), dtype, and head count (a tensor-parallel rank's attention holds `num_key_value_heads / world_size`
    heads), as transformers' own caches size their layers.

    Before each forward the engine calls `bind(rows, query_len)` (or `prepare` then `use`, to set up two
    concurrent forwards without waiting for the device): the forward covers `rows` (an index into the
    buffers, in the order of the forward's batch) with `query_len` tokens each. A forward over some rows only
    reads them in place when the model attends with `attention.ROW_RUNS` (`row_runs`, set by the backbone);
    otherwise `update` returns a gathered copy of those rows.
    """

    def __init__(self, num_layers: int, num_rows: int, capacity: int, device: torch.device | str = "cpu"):
        super().__init__(layers=[])
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.capacity = capacity
        # A forward reads its rows' slots up to its KV width, past a row's own length too (masked), so a slot must
        # hold a finite number before it is first read. CPU buffers are zeroed as forwards first reach their slots
        # (`prepare`) instead of up front: a full-capacity zeroing (the auto policy's capacity holds its largest
        # block and branches, 3x a plain step's width at 64 new tokens) cost 0.1 to 1 s of page faults per call at
        # 64 rows, most of which no forward reads. On other devices zeroing is cheap, and a second stream's forward
        # may read slots while the first is bound, so their buffers are zeroed whole when made.
        self.zeroed = 0  # slots [0, zeroed) of every CPU buffer hold finite numbers
        self._lazy: list[torch.Tensor] = []  # the CPU buffers, zeroed as forwards reach their slots
        # committed slots per row; kept on the host so binding a forward never waits for the device
        self.lengths = torch.zeros(num_rows, dtype=torch.long)
        self.device = torch.device(device)
        self._binding: Binding | None = None
        # the model attends with `attention.ROW_RUNS` (set by the backbone): a forward over some rows then
        # reads their keys/values in place instead of gathering a copy per layer
        self.row_runs = False
        # compiled forwards (compiled.py): every non-prefill forward writes with one scatter and, where it reads
        # runs, always through the runs op (attention.py), so the cache's code paths do not multiply the graphs a
        # compiled forward needs
        self.uniform = False

    @classmethod
    def for_model(cls, model, num_rows: int, capacity: int, device: torch.device | str | None = None) -> RowCache:
        """A cache for `model`'s decoder layers (`device`: where the model takes its inputs; default: where its
        first parameter is)."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return cls(cfg.num_hidden_layers, num_rows, capacity, device or next(model.parameters()).device)

    def _make(self, layer_idx: int, like: torch.Tensor) -> None:
        """Layer `layer_idx`'s buffers, shaped, typed and placed as the key states `like` [R, kv_heads, Q, hd]."""
        shape = (self.num_rows, like.shape[1], self.capacity, like.shape[3])
        lazy = like.device.type == "cpu"
        for store in (self.keys, self.values):
            buffer = (torch.empty if lazy else torch.zeros)(shape, dtype=like.dtype, device=like.device)
            if lazy:
                buffer[:, :, :self.zeroed].zero_()
                self._lazy.append(buffer)
            store[layer_idx] = buffer

    @property
    def made(self) -> bool:
        """Whether every layer has its buffers (made at its first write)."""
        return self.values[-1] is not None if self.values else True

    @property
    def num_rows(self) -> int:
        return self.lengths.shape[0]

    def prepare(self, rows: torch.Tensor, query_len: int, write_offset: int = 0) -> Binding:
        """Describe a forward over `rows` with `query_len` new tokens each, written `write_offset` slots past
        each row's committed length (a second concurrent forward writes past the first one's slots)."""
        rows_cpu = rows.cpu()
        base = self.lengths[rows_cpu] + write_offset
        write_pos = (base[:, None] + torch.arange(query_len)).to(self.device, non_blocking=True)  # [R, Q]
        kv_len = int(base.max()) + query_len
        if kv_len > self.capacity:
            raise RuntimeError(f"RowCache capacity {self.capacity} exceeded ({kv_len} slots needed)")
        if kv_len > self.zeroed:  # the forward reads these slots for the first time
            for buffer in self._lazy:
                buffer[:, :, self.zeroed:kv_len].zero_()
            self.zeroed = kv_len
        all_rows = rows_cpu.numel() == self.num_rows and bool((rows_cpu == torch.arange(self.num_rows)).all())
        fresh = not bool(base.any())
        start = int(base[0]) if all_rows and not self.uniform and bool((base == base[0]).all()) else None
        runs = None
        if self.row_runs and not fresh:
            runs = row_runs(rows_cpu.tolist(), (base + query_len).tolist())
            if all_rows and runs is not None and len(runs) == 1 and not self.uniform:
                runs = None  # every row at once over the full width: plain SDPA (compiled: the op, one graph)
        return Binding(rows.to(self.device), write_pos, kv_len, all_rows, start, fresh, runs, runs is not None)

    def use(self, binding: Binding) -> None:
        self._binding = binding
        set_runs(binding.runs)

    def bind(self, rows: torch.Tensor, query_len: int, write_offset: int = 0) -> int:
        """`prepare` + `use`; returns the KV width the forward sees."""
        binding = self.prepare(rows, query_len, write_offset)
        self.use(binding)
        return binding.kv_len

    def commit(self, rows: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Make the first `num_tokens[i]` written slots of `rows[i]` permanent."""
        self.lengths[rows.cpu()] += num_tokens.cpu()

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Free rows for new requests (continuous batching): their committed length becomes 0."""
        self.lengths[rows.cpu()] = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: [R, kv_heads, Q, head_dim]
        b = self._binding
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None:  # the layer's first write: its buffers are made where and as it runs
            self._make(layer_idx, key_states)
            keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows, write_pos = b.on(keys.device)
        if b.fresh:  # write the rows' first slots, attend over the new tensors (no read back of the buffers)
            q = key_states.shape[2]
            keys[rows, :, :q] = key_states.to(keys.dtype)
            values[rows, :, :q] = value_states.to(values.dtype)
            return key_states, value_states
        if b.start is not None:  # one slice for the whole batch (a plain copy, no scatter)
            end = b.start + key_states.shape[2]
            keys[:, :, b.start:end].copy_(key_states)
            values[:, :, b.start:end].copy_(value_states)
        else:
            row_idx = rows[:, None].expand_as(write_pos)
            keys[row_idx, :, write_pos] = key_states.transpose(1, 2).to(keys.dtype)
            values[row_idx, :, write_pos] = value_states.transpose(1, 2).to(values.dtype)
        if b.all_rows or b.in_runs:  # views; a subset's attention reads its runs of them in place
            return keys[:, :, :b.kv_len], values[:, :, :b.kv_len]
        return keys[rows, :, :b.kv_len], values[rows, :, :b.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where the bound forward's queries start (transformers 5.24 builds a mask from it when the forward passes
        none): a host int of the binding, so a compiled forward reads no tensor value (`get_seq_length`'s
        `.item()` was a graph break inside every compiled plain step)."""
        b = self._binding  # its longest row's first query slot: the KV width less the query tokens
        return b.kv_len - b.write_pos.shape[1] if b else self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self._binding.kv_len if self._binding else 0), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True
