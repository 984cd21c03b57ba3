"""A KV cache with one committed length per request row.

Rollback is simply not advancing a row's length: a forward writes its query tokens' keys/values into the
slots right after each row's committed length (scratch space), and only `commit` makes slots permanent.
The next forward overwrites whatever was not committed, so no masked holes accumulate and nothing is
copied per step. Which slots a query may see is the caller's 4D mask (see `masks.py`).

The cache is a `transformers.Cache` subclass: HF attention layers call `update(k, v, layer_idx)` and
attend over what it returns.
"""

from __future__ import annotations

import torch
from transformers import Cache


class RowCache(Cache):
    """Preallocated per-layer key/value buffers `[rows, kv_heads, capacity, head_dim]`.

    Args:
        num_layers, num_rows, num_kv_heads, head_dim, capacity: buffer geometry; `capacity` bounds
            longest prompt + new tokens + the widest query of a round.
        dtype, device: of the buffers.

    Before each forward the engine calls `bind(rows, query_len)`: the forward covers `rows` (an index
    into the buffers, in the order of the forward's batch) with `query_len` tokens each.
    """

    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(layers=[])
        shape = (num_rows, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.lengths = torch.zeros(num_rows, dtype=torch.long, device=device)  # committed slots per row
        self._rows: torch.Tensor | None = None
        self._all_rows = True
        self._write_pos: torch.Tensor | None = None
        self._kv_len = 0

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

    def bind(self, rows: torch.Tensor, query_len: int) -> int:
        """Prepare a forward over `rows` with `query_len` new tokens each; returns the KV width it sees."""
        self._rows = rows
        self._all_rows = rows.numel() == self.num_rows and bool((rows == torch.arange(
            self.num_rows, device=rows.device)).all())
        base = self.lengths[rows]
        self._write_pos = base[:, None] + torch.arange(query_len, device=rows.device)  # [R, Q]
        self._kv_len = int(base.max()) + query_len
        if self._kv_len > self.capacity:
            raise RuntimeError(f"RowCache capacity {self.capacity} exceeded ({self._kv_len} slots needed)")
        return self._kv_len

    def commit(self, rows: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Make the first `num_tokens[i]` written slots of `rows[i]` permanent."""
        self.lengths[rows] += num_tokens

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Free rows for new requests (continuous batching): their committed length becomes 0."""
        self.lengths[rows] = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: [R, kv_heads, Q, head_dim]
        rows, pos = self._rows, self._write_pos
        row_idx = rows[:, None].expand_as(pos)
        self.keys[layer_idx][row_idx, :, pos] = key_states.transpose(1, 2).to(self.keys[layer_idx].dtype)
        self.values[layer_idx][row_idx, :, pos] = value_states.transpose(1, 2).to(self.values[layer_idx].dtype)
        if self._all_rows:
            return self.keys[layer_idx][:, :, :self._kv_len], self.values[layer_idx][:, :, :self._kv_len]
        return self.keys[layer_idx][rows, :, :self._kv_len], self.values[layer_idx][rows, :, :self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._kv_len, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True
