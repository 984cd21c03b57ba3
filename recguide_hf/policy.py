"""Block-size policy and bucketing: which block size each request uses this round.

Fixed mode: every request uses the configured B. ("auto" is added by the adaptive-drafting issue.)
Requests are bucketed by planned block size: one draft and one verify forward per bucket.
"""

from __future__ import annotations

import torch

from .config import DecodingConfig


class BlockPolicy:
    def __init__(self, block_size: int):
        self.block_size = block_size

    @classmethod
    def from_config(cls, config: DecodingConfig) -> BlockPolicy:
        if config.block_size == "auto":
            return cls(max(config.block_sizes))
        return cls(int(config.block_size))

    def plan(self, rows: torch.Tensor, stats, pending_has: torch.Tensor) -> torch.Tensor:
        """Planned block size [R] for the active rows."""
        return torch.full_like(rows, self.block_size)

    def buckets(self, rows: torch.Tensor, stats, pending_has: torch.Tensor):
        """Yield (block size, rows) groups."""
        planned = self.plan(rows, stats, pending_has)
        for block in planned.unique().tolist():
            yield int(block), rows[planned == block]

    def branches_on(self, num_rows: int, block: int) -> bool:
        """Whether this forward should carry branches (the cost-aware rule lives here)."""
        return True
