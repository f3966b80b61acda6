"""The process group of a tensor-parallel engine: every rank's collectives, through torch.distributed.

Rank 0 is the engine's own process; ranks 1..N-1 are its worker processes. They meet through a file store (no
port to pick or race for) and talk through gloo on the CPU.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# a collective that waits this long for a rank gives up with an error, so a lost worker fails steps, not the server
COLLECTIVE_TIMEOUT_S = 120.0


class TensorParallelGroup:
    """This process's rank in the group and the collectives a sharded model's step needs."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world

    @classmethod
    def join(cls, store_file: str, rank: int, world: int, backend: str = "gloo",
             timeout_s: float = COLLECTIVE_TIMEOUT_S) -> "TensorParallelGroup":
        """Join the group (every rank calls this; it returns once all have)."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group; a tensor-parallel engine "
                               "needs a process of its own")
        dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, world)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place; returns t."""
        dist.all_reduce(t)
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t into every rank's t (same shape and dtype), in place; returns t."""
        dist.broadcast(t, src=0)
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's (N, C) t side by side on rank 0: (N, world * C) there, None elsewhere."""
        t = t.contiguous()
        if self.rank != 0:
            dist.gather(t, dst=0)
            return None
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.gather(t, gather_list=parts, dst=0)
        return torch.cat(parts, dim=1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
