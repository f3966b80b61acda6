"""The pipeline's driver copies on CUDA: bytes arrive as torch's copy puts them, from any thread."""
from __future__ import annotations

import threading

import pytest
import torch

from backend.runtime.driver_copy import DriverCopies, leading_bytes

pytestmark = pytest.mark.gpu


def _round_trip(copies: DriverCopies, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.arange(1000, dtype=torch.int64).pin_memory()
    back = torch.full((1000,), -1, dtype=torch.int64).pin_memory()
    dev = torch.full((1000,), -7, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    copies.copy(*leading_bytes(dev, host, n), stream.cuda_stream)
    copies.copy(*leading_bytes(back, dev, 1000), stream.cuda_stream)
    stream.synchronize()
    return dev.cpu(), back


def test_leading_bytes_go_there_and_back():
    dev, back = _round_trip(DriverCopies(torch.device("cuda", 0)), 600)
    want = torch.cat([torch.arange(600), torch.full((400,), -7)])
    assert torch.equal(dev, want) and torch.equal(back, want)


def test_a_thread_without_a_current_context_copies_too():
    copies, result = DriverCopies(torch.device("cuda", 0)), {}

    def work():
        try:
            result["back"] = _round_trip(copies, 1000)[1]
        except Exception as exc:  # noqa: BLE001 - reported to the test's thread
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert torch.equal(result["back"], torch.arange(1000))

