"""Which slice of each weight one rank of a tensor-parallel group holds (Megatron-style).

Attention heads and MLP columns are split over the ranks: the fused qkv and gate_up weights are column-parallel
(each rank keeps its heads' q, k and v rows, its share of the gate and up rows), o and down are row-parallel
(each rank keeps the matching input columns, and their outputs are summed over the ranks), the embedding and the
LM head are vocabulary-parallel (each rank keeps a contiguous range of token rows, padded so the ranks' ranges are
equal). Norms are replicated; a bias after a sum over the ranks is kept by rank 0 alone, so it is added once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from backend.models.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's place in a tensor-parallel group; world 1 holds every tensor whole."""

    rank: int = 0
    world: int = 1

    def check(self, spec: ModelSpec) -> None:
        """Raise ValueError when the model's heads or MLP width do not split evenly over the ranks."""
        for name, value in (("attention heads", spec.num_heads), ("key/value heads", spec.num_kv_heads),
                            ("intermediate size", spec.intermediate_size)):
            if value % self.world:
                raise ValueError(f"tensor_parallel_size {self.world} must divide the model's {name} ({value})")

    def spec(self, spec: ModelSpec) -> ModelSpec:
        """The shape one rank computes with: its heads and MLP columns; the vocabulary stays whole (the logits
        are gathered)."""
        if self.world == 1:
            return spec
        self.check(spec)
        return replace(spec, num_heads=spec.num_heads // self.world, num_kv_heads=spec.num_kv_heads // self.world,
                       intermediate_size=spec.intermediate_size // self.world)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first token id, rows) of this rank's vocabulary range; every rank holds the same number of rows."""
        rows = -(-vocab_size // self.world)
        return self.rank * rows, rows

    def _part(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(self.world, dim=dim)[self.rank]

    def qkv(self, t: torch.Tensor | None, spec: ModelSpec) -> torch.Tensor | None:
        """The fused q, k, v rows ((Hq + 2 Hkv) D, ...) of this rank's heads: its q heads, then its k and v heads."""
        if t is None or self.world == 1:
            return t
        d = spec.head_dim
        q, k, v = t.split([spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d], dim=0)
        return torch.cat([self._part(q, 0), self._part(k, 0), self._part(v, 0)], dim=0)

    def gate_up(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The fused gate and up rows (2 I, ...) of this rank's MLP columns: its gate rows, then its up rows."""
        if t is None or self.world == 1:
            return t
        gate, up = t.chunk(2, dim=0)
        return torch.cat([self._part(gate, 0), self._part(up, 0)], dim=0)

    def columns(self, t: torch.Tensor) -> torch.Tensor:
        """A row-parallel weight (out, in): this rank's input columns."""
        return t if self.world == 1 else self._part(t, 1)

    def first_only(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A bias added after the sum over the ranks: rank 0 keeps it, so it is added once."""
        return t if self.rank == 0 else None

    def vocab(self, t: torch.Tensor) -> torch.Tensor:
        """An embedding or LM head (V, H): this rank's token rows, the last rank's padded with zeros."""
        if self.world == 1:
            return t
        start, rows = self.vocab_rows(t.shape[0])
        part = t[start:start + rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *t.shape[1:])], dim=0)
        return part
