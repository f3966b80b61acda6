"""Copies between the pipeline's pinned host buffers and its device buffers, queued by one CUDA driver call each.

torch's `copy_` of a pinned buffer costs several times the driver call it makes: the dispatch, and an event it
records so the caching host allocator keeps the pinned block until the copy is done. The pipeline's buffers live
as long as the engine and a step copies the same leading bytes of them again and again, so a step's copies go
straight to `cuMemcpyAsync` with addresses worked out once.
"""
from __future__ import annotations

import ctypes

import torch


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current context


class DriverCopies:
    """cuMemcpyAsync on a given stream, between addresses of memory that outlives every copy queued."""

    def __init__(self, device: torch.device) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:  # torch runs on CUDA, so the driver library is there; say so if it is not
            raise RuntimeError(f"the CUDA driver library libcuda.so.1 could not be loaded: {exc}") from exc
        self._lib = lib
        self._ordinal = device.index if device.index is not None else torch.cuda.current_device()
        copy = lib.cuMemcpyAsync
        copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        copy.restype = ctypes.c_int
        self._copy = copy

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue nbytes from address src to address dst on the stream (its handle); returns without waiting."""
        if nbytes <= 0:
            return
        status = self._copy(dst, src, nbytes, stream)
        if status == _INVALID_CONTEXT:  # a thread that has made no runtime call yet: give it the device's context
            self._use_primary_context()
            status = self._copy(dst, src, nbytes, stream)
        if status:
            raise RuntimeError(f"cuMemcpyAsync of {nbytes} bytes failed: CUDA driver error {status}")

    def _use_primary_context(self) -> None:
        """Make the device's primary context (the one torch's runtime calls use) current on the calling thread."""
        device, context = ctypes.c_int(), ctypes.c_void_p()
        for name, args in (("cuDeviceGet", (ctypes.byref(device), self._ordinal)),
                           ("cuDevicePrimaryCtxRetain", (ctypes.byref(context), device)),
                           ("cuCtxSetCurrent", (context,))):
            status = getattr(self._lib, name)(*args)
            if status:
                raise RuntimeError(f"{name} failed: CUDA driver error {status}")
        # the retain above is balanced: torch holds the context for the process's life, the thread only uses it
        self._lib.cuDevicePrimaryCtxRelease(device)


def leading_bytes(dst: torch.Tensor, src: torch.Tensor, n: int) -> tuple[int, int, int]:
    """(dst address, src address, bytes) of the first n elements of two contiguous tensors of one dtype."""
    if dst.dtype != src.dtype or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("leading_bytes needs two contiguous tensors of one dtype")
    if n > min(dst.numel(), src.numel()):
        raise ValueError(f"{n} elements asked of tensors of {dst.numel()} and {src.numel()}")
    return dst.data_ptr(), src.data_ptr(), n * dst.element_size()
