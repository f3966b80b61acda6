"""StepOps: the op set each kind of step launches its kernels with."""
from __future__ import annotations

from dataclasses import dataclass

from backend.ops import Ops


@dataclass(frozen=True, slots=True)
class StepOps:
    """Decode steps of at most max_dependent_rows rows launch with `dependent`, every other step with `plain`.

    Programmatic dependent launch lets a kernel start while the one before it ends: the overlap pays where kernels
    are short (small decode batches), while a graph of dependent launches costs about twice the CPU time to replay.
    Where launches are not split by step kind both op sets are the same. The fused sampler's kernels (their own
    graphs, after the forward's) keep the model's own launch mode."""

    dependent: Ops
    plain: Ops
    max_dependent_rows: int

    @classmethod
    def uniform(cls, ops: Ops) -> "StepOps":
        """Every step with the same op set."""
        return cls(ops, ops, 0)

    def decode(self, rows: int) -> Ops:
        """The op set of a decode step (every row one token) of `rows` rows, padding included."""
        return self.dependent if rows <= self.max_dependent_rows else self.plain

    @property
    def mixed(self) -> Ops:
        """The op set of a step holding prefill chunks: its kernels are long, so the overlap gains little."""
        return self.plain
