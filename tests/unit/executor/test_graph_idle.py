"""Graph idle from a profiler's kernels: grouped behind spin kernels on their stream, each group's event spans less
the union of its kernels, per replay."""
from __future__ import annotations

import pytest

from backend.executor.graph_idle import idle_per_replay, is_kernel

SPIN = "void at::cuda::(anonymous namespace)::spin_kernel(long)"


def test_each_group_is_its_spans_less_its_kernels_union_per_replay():
    kernels = [
        (SPIN, 7, 0.0, 2.0),
        ("gemm", 7, 2.0, 3.0), ("norm", 7, 3.5, 4.0),  # replay 1 of group 1: spans 2-4.2
        ("gemm", 7, 4.2, 5.2), ("norm", 7, 5.7, 6.2),  # replay 2
        ("fill", 3, 6.5, 6.6),  # the next group's input set-up, on another stream: not counted
        (SPIN, 7, 7.0, 9.0),
        ("attn", 7, 9.0, 10.0), ("attn2", 7, 9.8, 10.5),  # overlapping (programmatic dependent launch): union 1.5
    ]
    idle = idle_per_replay(kernels, [[2.2, 2.0], [1.5]])
    # group 1: spans 4.2 s, kernels 1 + 0.5 + 1 + 0.5 = 3 s, so 0.6 s a replay; group 2: none
    assert idle == pytest.approx([0.6, 0.0])


def test_kernels_out_of_order_are_sorted_and_idle_never_reads_negative():
    kernels = [("k", 1, 3.0, 4.0), (SPIN, 1, 0.0, 3.0)]
    assert idle_per_replay(kernels, [[0.9]]) == [0.0]  # an event span a little shorter than its kernels


def test_a_record_that_does_not_match_the_replays_gives_none():
    assert idle_per_replay([(SPIN, 1, 0.0, 1.0), ("k", 1, 1.0, 2.0)], [[1.0], [1.0]]) is None  # one group of two
    assert idle_per_replay([(SPIN, 1, 0.0, 1.0), (SPIN, 1, 1.0, 2.0), ("k", 1, 2.0, 3.0)], [[1.0], [1.0]]) is None
    assert idle_per_replay([(SPIN, 1, 0.0, 1.0), (SPIN, 2, 1.0, 2.0)], [[1.0], [1.0]]) is None  # two spin streams
    assert idle_per_replay([("k", 1, 0.0, 1.0)], [[1.0]]) is None  # no spin kernel at all


def test_copies_and_memsets_are_not_kernels():
    assert is_kernel("gemm") and is_kernel(SPIN)
    for name in ("Memcpy HtoD (Pinned -> Device)", "Memset (Device)", "cudaMemcpyAsync", "cudaMemsetAsync"):
        assert not is_kernel(name)
