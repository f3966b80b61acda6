"""ModelSpec: the shape facts of a loaded model that the rest of the engine sizes itself from."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Sizes, limits and stop tokens of one loaded model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    model_type: str

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the one KV tensor the model reads: (layers, 2, blocks, block_size, kv_heads, head_dim)."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_block(self, block_size: int, cache_dtype: torch.dtype | None = None) -> int:
        """Bytes one KV block costs across all layers (K and V) in a cache of cache_dtype (None: the model's)."""
        elem = torch.empty((), dtype=cache_dtype or self.dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * elem
