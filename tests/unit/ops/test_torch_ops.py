"""The plain-torch ops that have no transformers counterpart to be checked against: linear into out, greedy pick."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.ops import get_ops
from backend.ops.torch import layers


@pytest.mark.parametrize("bias", [False, True])
def test_linear_into_out_equals_f_linear(bias):
    """out= writes F.linear's exact result into the given rows of a larger buffer, and returns that buffer."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 48, generator=g), torch.randn(40, 48, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    buf = torch.full((7, 40), float("nan"))
    got = layers.linear(x, w, b, out=buf[:5])
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:5], F.linear(x, w, b))
    assert buf[5:].isnan().all()
    assert torch.equal(layers.linear(x, w, b), F.linear(x, w, b))


def test_linear_into_out_needs_2d_x():
    with pytest.raises(ValueError, match="2-D x"):
        layers.linear(torch.zeros(2, 3, 8), torch.zeros(4, 8), out=torch.empty(6, 4))


def test_greedy_argmax_first_maximum_into_out():
    """Ties give the first index, as torch.argmax and transformers' greedy search do; out is written in place."""
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [float("-inf")] * 4, [2.0, 1.0, 0.0, 2.0]])
    out = torch.full((3,), -1, dtype=torch.int64)
    assert layers.greedy_argmax(logits, out) is out
    assert out.tolist() == [1, 0, 0]


def test_torch_ops_carry_the_greedy_pick_and_linear():
    ops = get_ops("torch")
    assert ops.greedy_argmax is layers.greedy_argmax and ops.linear is layers.linear
    # the torch path never parks partials and runs the gate_up GEMM and SiLU-and-mul as two ops
    assert ops.linear_parked is layers.linear
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(4, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    assert torch.equal(ops.linear_silu_and_mul(x, w, b), layers.silu_and_mul(F.linear(x, w, b)))
    assert torch.equal(ops.linear_silu_and_mul(x, w), layers.silu_and_mul(F.linear(x, w)))
    # against the two halves' GEMMs apart: a CPU's BLAS may sum one 24-column GEMM in another order than two of 12
    torch.testing.assert_close(ops.linear_silu_and_mul(x, w), F.silu(x @ w[:12].T) * (x @ w[12:].T))


def test_partial_sums_split_and_view_keep_the_split_dim_in_front():
    """split / view act on the GEMM output's dims; every piece is a view of the same parts."""
    from backend.ops.partial_sums import PartialSums

    parts = torch.randn(3, 5, 12)
    q, k, v = PartialSums(parts, torch.bfloat16).split([8, 2, 2], dim=-1)
    assert (q.shape, k.shape, v.shape) == ((5, 8), (5, 2), (5, 2)) and q.dtype == torch.bfloat16
    assert torch.equal(k.parts, parts[:, :, 8:10]) and k.parts.data_ptr() == parts[:, :, 8:].data_ptr()
    heads = q.view(5, 4, 2)
    assert heads.shape == (5, 4, 2) and torch.equal(heads.parts, parts[:, :, :8].reshape(3, 5, 4, 2))
    assert heads.parts.stride(0) == parts.stride(0)
    with pytest.raises(ValueError, match="last dim"):
        PartialSums(parts, torch.bfloat16).split([2, 3], dim=0)
