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


def test_a_slots_leading_rows_are_views_of_the_leading_elements():
    from backend.executor.pipeline import Slot, SlotLayout

    slot = Slot(0, SlotLayout(max_tokens=8, max_seqs=4, max_blocks=3, max_logprobs=2), torch.device("cpu"), False)
    lead = slot.leading("host_top_ids", "out_top_ids", 3)  # (S, K) buffers: 3 rows of 2
    assert lead is slot.leading("host_top_ids", "out_top_ids", 3)  # worked out once per row count
    assert lead.dst.data_ptr() == slot.host_top_ids.data_ptr() and lead.dst.numel() == 6
    assert lead.copy_args is None  # host memory both: torch's copy_ takes the views
    # with CUDA the arguments are these views' own
    assert leading_bytes(lead.dst, lead.src, 6) == (slot.host_top_ids.data_ptr(), slot.out_top_ids.data_ptr(), 6 * 8)
    slot.out_top_ids.copy_(torch.arange(8).view(4, 2))
    lead.dst.copy_(lead.src)
    assert slot.host_top_ids.tolist() == [[0, 1], [2, 3], [4, 5], [0, 0]]
