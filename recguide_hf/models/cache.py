"""A KV cache with one committed length per request row.

Rollback is simply not advancing a row's length: a forward writes its query tokens' keys/values into the
slots right after each row's committed length (scratch space), and only `commit` makes slots permanent.
The next forward overwrites whatever was not committed, so no masked holes accumulate and nothing is
copied per step. Which slots a query may see is the caller's 4D mask (see `masks.py`).

The cache is a `transformers.Cache` subclass: HF attention layers call `update(k, v, layer_idx)` and
attend over what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class RowCache(Cache):
    """Preallocated per-layer key/value buffers `[rows, kv_heads, capacity, head_dim]`.

    Args:
        num_layers, num_rows, num_kv_heads, head_dim, capacity: buffer geometry; `capacity` bounds
            longest prompt + new tokens + the widest query of a round.
        dtype, device: of the buffers.

    Before each forward the engine calls `bind(rows, query_len)` (or `prepare` then `use`, to set up two
    concurrent forwards without waiting for the device): the forward covers `rows` (an index into the
    buffers, in the order of the forward's batch) with `query_len` tokens each. A forward over some rows only
    reads them in place when the model attends with `attention.ROW_RUNS` (`row_runs`, set by the backbone);
    otherwise `update` returns a gathered copy of those rows.
    """

    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(layers=[])
        shape = (num_rows, num_kv_heads, capacity, head_dim)
        # A forward reads its rows' slots up to its KV width, past a row's own length too (masked), so a slot must
        # hold a finite number before it is first read. On the CPU the buffers are zeroed as forwards first reach
        # their slots (`prepare`) instead of up front: a full-capacity zeroing (the auto policy's capacity holds its
        # largest block and branches, 3x a plain step's width at 64 new tokens) cost 0.1 to 1 s of page faults per
        # call at 64 rows, most of which no forward reads. On other devices zeroing is cheap, and a second stream's
        # forward may read slots while the first is bound, so they are zeroed at once.
        lazy = torch.device(device).type == "cpu"
        make = torch.empty if lazy else torch.zeros
        self.keys = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.zeroed = 0 if lazy else capacity  # slots [0, zeroed) of every row hold finite numbers
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
    def for_model(cls, model, num_rows: int, capacity: int) -> RowCache:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        return cls(cfg.num_hidden_layers, num_rows, cfg.num_key_value_heads, head_dim, capacity,
                   dtype=param.dtype, device=param.device)

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
            for buffer in (*self.keys, *self.values):
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
        if b.fresh:  # write the rows' first slots, attend over the new tensors (no read back of the buffers)
            q = key_states.shape[2]
            self.keys[layer_idx][b.rows, :, :q] = key_states.to(self.keys[layer_idx].dtype)
            self.values[layer_idx][b.rows, :, :q] = value_states.to(self.values[layer_idx].dtype)
            return key_states, value_states
        if b.start is not None:  # one slice for the whole batch (a plain copy, no scatter)
            end = b.start + key_states.shape[2]
            self.keys[layer_idx][:, :, b.start:end].copy_(key_states)
            self.values[layer_idx][:, :, b.start:end].copy_(value_states)
        else:
            row_idx = b.rows[:, None].expand_as(b.write_pos)
            self.keys[layer_idx][row_idx, :, b.write_pos] = key_states.transpose(1, 2).to(self.keys[layer_idx].dtype)
            self.values[layer_idx][row_idx, :, b.write_pos] = value_states.transpose(1, 2).to(
                self.values[layer_idx].dtype)
        if b.all_rows or b.in_runs:  # views; a subset's attention reads its runs of them in place
            return self.keys[layer_idx][:, :, :b.kv_len], self.values[layer_idx][:, :, :b.kv_len]
        return self.keys[layer_idx][b.rows, :, :b.kv_len], self.values[layer_idx][b.rows, :, :b.kv_len]

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
