"""Which graph a drafted step replays: the mixed graph of its token count where that graph's logits rows (up to the
sequence limit) hold every drafted position, else the verify graph of that count (logits at every token, up to the
layout's rows), else none (the step runs eagerly)."""
from __future__ import annotations

import pytest
import torch

from backend.executor.graphs import DecodeGraphs
from backend.executor.pipeline import SlotLayout


def _graphs(max_rows: int, mixed: bool = True) -> DecodeGraphs:
    layout = SlotLayout(max_tokens=256, max_seqs=16, max_blocks=8, max_logprobs=0, max_rows=max_rows)
    body = (lambda *args: None) if mixed else None
    return DecodeGraphs(lambda *args: None, None, torch.device("cpu"), layout, 16, None, 16, mixed=body)


def test_verify_buckets_lie_above_the_sequence_limit_up_to_the_rows():
    assert _graphs(max_rows=80).verify_buckets == [32, 64, 128]
    assert _graphs(max_rows=256).verify_buckets == [32, 64, 128, 192, 256]
    assert _graphs(max_rows=16).verify_buckets == []  # no speculation: rows never outnumber sequences
    assert _graphs(max_rows=80, mixed=False).verify_buckets == []  # no mixed graphs: drafted steps run eagerly


@pytest.mark.parametrize("tokens,rows,want", [
    (5, 5, ("mixed", 16)),  # one row and four drafts
    (20, 16, ("mixed", 32)),  # the 32-token mixed graph computes 16 logits rows
    (20, 17, ("verify", 32)),
    (100, 80, ("verify", 128)),
    (200, 16, ("mixed", 256)),
    (200, 80, None),  # prefill chunks beside drafts, past the verify buckets
    (300, 1, None),  # over the step's token budget
])
def test_a_drafted_step_takes_the_first_graph_that_holds_its_tokens_and_rows(tokens, rows, want):
    graphs = _graphs(max_rows=80)
    assert graphs.verify_bucket_for(tokens, rows) == want
    if want is not None:
        assert graphs.verify_logits_rows(want) >= rows
