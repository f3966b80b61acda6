"""The asynchronous step pipeline: three CUDA streams, events between them, two alternating slots.

Step N+1 is packed on the CPU and queued on the GPU while step N still runs; the CPU blocks once per step,
on step N's device-to-host event. Without CUDA the same code runs with streams and events as no-ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backend.executor.sampler import SampleTargets
from backend.runtime.driver_copy import DriverCopies, leading_bytes
from backend.runtime.timeline import Timeline


@dataclass
class SlotLayout:
    """Sizes of one slot's buffers."""

    max_tokens: int  # tokens of one step
    max_seqs: int  # requests of one step
    max_blocks: int  # block-table width
    max_logprobs: int  # top-n logprobs carried back
    max_rows: int = 0  # logits and sampling rows of one step: max_seqs, or more where rows take drafted tokens

    def __post_init__(self) -> None:
        self.max_rows = max(self.max_rows, self.max_seqs)


class Slot:
    """One set of pinned host buffers and device buffers for a step's inputs and outputs."""

    def __init__(self, index: int, layout: SlotLayout, device: torch.device, use_cuda: bool) -> None:
        self.index = index
        self._make_inputs(layout, device, use_cuda)
        # per block-table row: (the request's block list, blocks written), so a step writes only new blocks
        self.table_owners: list[tuple[list[int], int] | None] = [None] * layout.max_seqs
        # (running batch's serial, per block-table row the table_ids of the decode row whose blocks it holds (-1:
        # none), how many of them) since the slot was last packed from that batch, or None: the next pack writes
        # only the rows that moved and the blocks added
        self.row_tables: tuple[int, np.ndarray, np.ndarray] | None = None
        # leading rows whose query_start_loc ([0, rows]) and logits_idx ([0, rows)) hold 0, 1, 2, ... in the host
        # buffers (one token and one logits row each, as decode and padding rows have): the pack skips them
        self.arange_rows = 0
        # rows [start, end) that hold a decode graph's padding in the host buffers since the packer wrote it, or None
        self.decode_padding: tuple[int, int] | None = None
        self._make_outputs(layout, device, use_cuda)
        self.h2d_done = _Event(use_cuda)
        self.compute_done = _Event(use_cuda)
        self.d2h_done = _Event(use_cuda)
        self.in_use = False  # a launched step's results are still unread
        # the queued forward's (whether it was one graph replay, the idle inside it), for its sampling launch's span
        self.forward_replay: tuple[bool, float | None] = (False, 0.0)
        self._leading: dict[tuple[str, str, int], LeadingRows] = {}

    def _make_inputs(self, layout: SlotLayout, device: torch.device, pin: bool) -> None:
        """Every input in one pinned buffer and its device twin, in three typed regions (each 8-byte aligned), so a
        step's inputs go over in one copy: all of it up to the block-table rows the step uses."""
        T, S, W, R = layout.max_tokens, layout.max_seqs, layout.max_blocks, layout.max_rows
        # int64 region: input_ids | positions | slot_mapping | carry_src | logits_idx | sampling (seeds, step)
        self.i64_sizes = dict(input_ids=T, positions=T, slot_mapping=T, carry_src=T, logits_idx=R,
                              sampling_i=2 * R)
        # float32 region: the sampler's six per-row settings, laid out (6, R)
        self.f32_sizes = dict(sampling_f=6 * R)
        # int32 region: query_start_loc | seq_lens | top_k | block_tables (last, so a prefix copy suffices)
        self.i32_sizes = dict(query_start_loc=S + 1, seq_lens=S, top_k=R, block_tables=S * W)
        self.i32_prefix = 2 * S + 1 + R  # elements before the block tables
        i64_bytes = 8 * sum(self.i64_sizes.values())
        f32_bytes = 8 * -(-sum(self.f32_sizes.values()) // 2)
        self.i32_offset = i64_bytes + f32_bytes  # bytes before the int32 region
        self.host_inputs = torch.zeros(self.i32_offset + 4 * sum(self.i32_sizes.values()), dtype=torch.uint8,
                                       pin_memory=pin)
        self.dev_inputs = torch.zeros_like(self.host_inputs, device=device)
        self.host_i64, self.host_f32, self.host_i32 = _regions(self.host_inputs, i64_bytes, self.i32_offset)
        self.dev_i64, self.dev_f32, self.dev_i32 = _regions(self.dev_inputs, i64_bytes, self.i32_offset)
        self.host = _views(self.host_i64, self.i64_sizes) | _views(self.host_i32, self.i32_sizes) | _views(
            self.host_f32, self.f32_sizes)
        self.dev = _views(self.dev_i64, self.i64_sizes) | _views(self.dev_i32, self.i32_sizes) | _views(
            self.dev_f32, self.f32_sizes)
        self.host["block_tables"] = self.host["block_tables"].view(S, W)
        self.dev["block_tables"] = self.dev["block_tables"].view(S, W)
        self.np = {k: v.numpy() for k, v in self.host.items()}  # numpy views of the pinned buffers
        # the sampler's per-row settings as (field, row) arrays: floats (6, R), seeds and step indices (2, R), top-k
        self.sampling_host = (self.np["sampling_f"].reshape(6, R), self.np["sampling_i"].reshape(2, R),
                              self.np["top_k"])
        self._sampling_views: dict[int, tuple[torch.Tensor, ...]] = {}

    def _make_outputs(self, layout: SlotLayout, device: torch.device, pin: bool) -> None:
        """Sampled tokens and their logprobs: written by the compute stream, copied back by D2H."""
        S, K = layout.max_rows, max(1, layout.max_logprobs)
        self.out_tokens = torch.zeros(S, dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros(S, dtype=torch.float32, device=device)
        self.out_ranks = torch.zeros(S, dtype=torch.int64, device=device)
        self.out_top_ids = torch.zeros(S, K, dtype=torch.int64, device=device)
        self.out_top_logprobs = torch.zeros(S, K, dtype=torch.float32, device=device)
        self.out_lse = torch.zeros(S, dtype=torch.float32, device=device)  # the fused sampler's log-sum-exp
        self.targets = SampleTargets(self.out_tokens, self.out_logprobs, self.out_ranks, self.out_top_ids,
                                     self.out_top_logprobs, self.out_lse)
        self.host_tokens = torch.zeros(S, dtype=torch.int64, pin_memory=pin)
        self.host_logprobs = torch.zeros(S, dtype=torch.float32, pin_memory=pin)
        self.host_ranks = torch.zeros(S, dtype=torch.int64, pin_memory=pin)
        self.host_top_ids = torch.zeros(S, K, dtype=torch.int64, pin_memory=pin)
        self.host_top_logprobs = torch.zeros(S, K, dtype=torch.float32, pin_memory=pin)

    def forget_tables(self) -> None:
        """The host block tables hold nothing known: the next pack writes whole rows."""
        self.table_owners = [None] * len(self.table_owners)
        self.row_tables = None
        self.arange_rows = 0

    def input_bytes(self, n_i32: int) -> int:
        """Bytes of the input buffer a step copies over: every region, the int32 one up to n_i32 elements."""
        return self.i32_offset + 4 * n_i32

    def sampling_views(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The device rows [0, rows) of each sampling setting, made once per row count (views cost µs each):
        temperature, top_p, min_p, repetition, presence and frequency penalties, seeds, step indices, top_k."""
        views = self._sampling_views.get(rows)
        if views is None:
            S = self.out_tokens.shape[0]
            f = self.dev["sampling_f"].view(6, S)[:, :rows]
            i = self.dev["sampling_i"].view(2, S)[:, :rows]
            views = self._sampling_views[rows] = (*f.unbind(0), *i.unbind(0), self.dev["top_k"][:rows])
        return views

    def leading(self, dst_name: str, src_name: str, rows: int) -> "LeadingRows":
        """The first rows rows of two of this slot's buffers, as views (torch's copy_) and, with CUDA, as a driver
        copy's arguments, worked out once per row count: views and addresses cost µs each step."""
        key = (dst_name, src_name, rows)
        lead = self._leading.get(key)
        if lead is None:
            dst, src = getattr(self, dst_name), getattr(self, src_name)
            per_row = dst[0].numel() if dst.dim() > 1 else 1
            n = rows * per_row
            flat_dst, flat_src = dst.view(-1), src.view(-1)
            args = leading_bytes(flat_dst, flat_src, n) if flat_dst.is_cuda or flat_src.is_cuda else None
            lead = self._leading[key] = LeadingRows(flat_dst[:n], flat_src[:n], args)
        return lead


@dataclass(frozen=True, slots=True)
class LeadingRows:
    """A buffer's leading rows and their source's: views for torch's copy_, (dst, src, bytes) for a driver copy
    (None where both buffers are in host memory: torch's copy_ takes them)."""

    dst: torch.Tensor
    src: torch.Tensor
    copy_args: tuple[int, int, int] | None


def _regions(flat: torch.Tensor, f32_offset: int, i32_offset: int) -> tuple[torch.Tensor, ...]:
    """The int64, float32 and int32 regions of a byte buffer, as typed views."""
    return (flat[:f32_offset].view(torch.int64), flat[f32_offset:i32_offset].view(torch.float32),
            flat[i32_offset:].view(torch.int32))


def _views(flat: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, n in sizes.items():
        out[name] = flat[offset:offset + n]
        offset += n
    return out


class _Event:
    """A CUDA event, or a no-op without CUDA (CPU work is already complete when it is 'recorded')."""

    def __init__(self, use_cuda: bool) -> None:
        self.event = torch.cuda.Event() if use_cuda else None

    def record(self, stream) -> None:
        if self.event is not None:
            self.event.record(stream)

    def wait(self, stream) -> None:
        if self.event is not None:
            self.event.wait(stream)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class Pipeline:
    """Streams, the two slots and the single blocking point of a step."""

    def __init__(self, layout: SlotLayout, device: torch.device, timeline: Timeline) -> None:
        self.device = device
        self.use_cuda = device.type == "cuda"
        self.timeline = timeline
        if self.use_cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.compute_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            self.home_stream = torch.cuda.default_stream(device)  # current again after each launch
            self.copies = DriverCopies(device)
            self._h2d_handle, self._d2h_handle = self.h2d_stream.cuda_stream, self.d2h_stream.cuda_stream
        else:
            self.h2d_stream = self.compute_stream = self.d2h_stream = self.home_stream = None
            self.copies = None  # CPU tensors: torch's copy_
            self._h2d_handle = self._d2h_handle = 0
        self.slots = [Slot(0, layout, device, self.use_cuda), Slot(1, layout, device, self.use_cuda)]
        self._next = 0

    def _use(self, stream) -> None:
        """Make stream current for this thread. `torch.cuda.stream(...)` as a context costs tens of µs a step
        (device lookups and a Stream object each time); the loop thread's stream is only ever ours or home."""
        if stream is not None:
            torch.cuda.set_stream(stream)

    def acquire_slot(self) -> Slot:
        """The slot the next step packs into; its previous step's results have been read already."""
        slot = self.slots[self._next]
        if slot.in_use:
            raise RuntimeError("pipeline slot reused before its results were read")
        self._next ^= 1
        return slot

    def other(self, slot: Slot) -> Slot:
        return self.slots[slot.index ^ 1]

    def launch_forward(self, slot: Slot, n_i32: int, forward: Callable[[], tuple[bool, float | None]]) -> None:
        """Queue the H2D copy and then the forward on the compute stream; returns without waiting. The copy takes
        every input but the int32 region past n_i32 elements (block-table rows the step does not use). forward
        queues the step's forward and returns (whether it was one CUDA graph replay, the idle seconds inside that
        graph or None where unknown). launch_sampling queues the rest of the step."""
        tl = self.timeline
        # No stream waits for this slot's previous step: the host synchronized on its d2h_done before the slot was
        # free again (acquire_slot), and that event follows the step's reads of the device inputs and its writes
        # of the outputs, so neither this copy nor this compute can overtake them.
        tl.gpu_begin("h2d", self.h2d_stream, copy=True)
        self._copy(slot, "dev_inputs", "host_inputs", slot.input_bytes(n_i32), self._h2d_handle)
        tl.gpu_end("h2d", self.h2d_stream, gap_free=True)  # one copy: no launch gaps
        # why: compute may start only once this step's inputs are on the device
        slot.h2d_done.record(self.h2d_stream)
        try:
            self._use(self.compute_stream)
            slot.h2d_done.wait(self.compute_stream)
            tl.gpu_begin("compute", self.compute_stream)
            slot.forward_replay = forward()
        finally:
            self._use(self.home_stream)

    def launch_sampling(self, slot: Slot, sample: Callable[[], tuple[int, bool, float | None]], read_logprobs: bool,
                        deferred: bool = False) -> None:
        """Queue the sampling after the forward on the compute stream, then the D2H copy of its outputs; returns
        without waiting. sample returns (rows sampled, whether its work was CUDA graph replays or nothing, the idle
        seconds inside those graphs or None where unknown); deferred: the host did other work since the forward was
        queued, so the GPU may have idled between them. Only the forward and the sampling run on a current stream
        (graph replays launch there); the copies, events and waits name theirs."""
        tl = self.timeline
        try:
            self._use(self.compute_stream)
            rows, sample_replays, sample_idle = sample()
            forward_replay, forward_idle = slot.forward_replay
            # a graph replay is one launch, its kernels back to back: the span holds no launch gaps, only the graphs'
            # inner idle, measured once (None: not measured, so the span's busy time is not known)
            gap_free = forward_replay and sample_replays and not deferred
            idle_s = None if forward_idle is None or sample_idle is None else forward_idle + sample_idle
            tl.gpu_end("compute", self.compute_stream, gap_free=gap_free, idle_s=idle_s if gap_free else 0.0)
            # why: the D2H copy may start only when sampling has written the outputs
            slot.compute_done.record(self.compute_stream)
        finally:
            self._use(self.home_stream)
        slot.compute_done.wait(self.d2h_stream)
        tl.gpu_begin("d2h", self.d2h_stream, copy=True)
        self._copy(slot, "host_tokens", "out_tokens", rows, self._d2h_handle)
        if read_logprobs:
            for dst, src in (("host_logprobs", "out_logprobs"), ("host_ranks", "out_ranks"),
                             ("host_top_ids", "out_top_ids"), ("host_top_logprobs", "out_top_logprobs")):
                self._copy(slot, dst, src, rows, self._d2h_handle)
        # the tokens alone are one copy, no launch gaps; with logprobs, five launches: the GPU's progress decides
        tl.gpu_end("d2h", self.d2h_stream, gap_free=not read_logprobs)
        # why: the host waits on this event, the one blocking point of a step
        slot.d2h_done.record(self.d2h_stream)
        slot.in_use = True

    def _copy(self, slot: Slot, dst: str, src: str, rows: int, stream: int) -> None:
        """The first rows rows of slot buffer src into slot buffer dst: a driver copy queued on the stream (its
        handle) with CUDA, torch's copy_ without."""
        lead = slot.leading(dst, src, rows)
        if self.copies is not None:
            self.copies.copy(*lead.copy_args, stream)
        else:
            lead.dst.copy_(lead.src)

    def wait(self, slot: Slot) -> None:
        """Block until slot's results are in host memory: the engine loop's only synchronisation."""
        with self.timeline.cpu_span("wait"):
            slot.d2h_done.synchronize()
        slot.in_use = False
