"""The driver copies' arguments: addresses and byte counts of leading elements, refused where they cannot hold."""
from __future__ import annotations

import pytest
import torch

from backend.runtime.driver_copy import leading_bytes


def test_leading_bytes_are_addresses_and_element_bytes():
    dst, src = torch.zeros(10, dtype=torch.float32), torch.ones(10, dtype=torch.float32)
    assert leading_bytes(dst, src, 3) == (dst.data_ptr(), src.data_ptr(), 12)


def test_mismatched_dtypes_strided_views_and_overlong_counts_are_refused():
    with pytest.raises(ValueError, match="one dtype"):
        leading_bytes(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="contiguous"):
        leading_bytes(torch.zeros(8)[::2], torch.zeros(4), 2)
    with pytest.raises(ValueError, match="5 elements asked of tensors of 4 and 6"):
        leading_bytes(torch.zeros(4), torch.zeros(6), 5)
