"""Packs a scheduled batch into a pipeline slot, runs carry-over + forward + sampling, reads results back."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .graphs import DecodeGraphs
from .kv_cache import NULL_BLOCK
from .ops.attention import AttentionMetadata
from .pipeline import Pipeline, Slot, SlotLayout
from .request import Request
from .logit_rules import logit_edits
from .sampler import Sampler, SamplingTensors, assemble_tensors, fill_host_rows, fill_padding_rows, pad_token_table
from .scheduler import ScheduledBatch
from .timeline import Timeline


@dataclass(slots=True)
class StepState:
    """A launched step: what it holds and where its results land."""

    batch: ScheduledBatch
    slot: Slot
    sampled: list[Request] = field(default_factory=list)  # requests in output-row order
    row_of: dict[int, int] = field(default_factory=dict)  # id(request) → output row
    read_logprobs: bool = False
    num_top: int = 0
    max_len: int = 0  # longest context of the batch after this step
    steady_version: int = -1  # the steady batch's version when this step was packed from it


@dataclass(slots=True)
class StepResult:
    """Tokens (and logprobs) read back for each sampled request of a step."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None  # the sampled token's rank in its row, with logprobs
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class ModelRunner:
    """Owns the KV cache, the slots' contents and the model call of every step."""

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, layout: SlotLayout,
                 device: torch.device, timeline: Timeline, use_graphs: bool, max_graph_batch: int) -> None:
        self.model = model
        self.kv_cache = kv_cache  # (L, 2, NB, BS, Hkv, D)
        self.block_size = block_size
        self.layout = layout
        self.device = device
        self.timeline = timeline
        self.pipeline = Pipeline(layout, device, timeline)
        self.sampler = Sampler()
        self.vocab_size = model.spec.vocab_size
        self.sampler.vocab_hash(self.vocab_size, device)  # cached before any graph capture
        self._arange = np.arange(layout.max_seqs + 1)  # query_start_loc and logits_idx of decode-only steps
        if device.type == "cuda" or model.ops.name.startswith("triton"):
            # before the capture, whose own warm-up resets the inputs it reads; wherever Triton kernels run, also
            # under Triton's CPU interpreter, so the CPU tests run the warm-up's steps too
            self.warm_up_prefill()
        self.graphs: DecodeGraphs | None = None
        if use_graphs:  # without CUDA: the same decode-graph step, run eagerly
            self.graphs = DecodeGraphs(self, max_graph_batch)
            self.graphs.capture_all()

    def warm_up_prefill(self) -> list[tuple[int, int]]:
        """Run the eager forward (prefill, mixed and penalised steps) on harmless inputs; returns its (sequences,
        tokens each) shapes.

        Decode graphs compile their kernels when they are captured, but only for the buckets' row counts; the eager
        path's kernels would otherwise compile inside the first requests that need them, and a compile stops the
        loop for a few hundred milliseconds. Every sequence lives in the null block, as in the graphs' capture."""
        shapes = self._warm_up_shapes()
        slot = self.pipeline.slots[0]
        d = slot.dev
        with torch.no_grad():
            for num_seqs, q in shapes:
                t = num_seqs * q
                d["positions"][:t].copy_(torch.arange(q, device=self.device).repeat(num_seqs))
                d["seq_lens"][:num_seqs].fill_(q)
                d["query_start_loc"][:num_seqs + 1].copy_(
                    torch.arange(0, t + 1, q, dtype=torch.int32, device=self.device))
                d["logits_idx"][:num_seqs].copy_(torch.arange(q - 1, t, q, device=self.device))
                self._eager_forward(slot, num_seqs, t, -(-q // self.block_size), q, q, None, num_seqs)
            for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables", "query_start_loc",
                         "logits_idx"):
                d[name].zero_()  # as the slot was made: a step's pack writes only the parts it changes
            slot.table_owners = [None] * len(slot.table_owners)  # so the next pack writes whole block-table rows
        if self.device.type == "cuda":
            # why: the first step's host-to-device copies run on another stream and must not race these resets
            torch.cuda.synchronize(self.device)
        return shapes

    def _warm_up_shapes(self) -> list[tuple[int, int]]:
        """Steps whose kernels the decode graphs do not compile, each kept if the step's token budget, the
        sequence limit and the block table allow it: one 17-token prompt (prefill attention); three of 12 (36
        rows: the decode GEMMs at 33-63 rows, where the graphs have only 48 and 64, which Triton compiles apart
        as multiples of 16); 37 one-token rows (decode attention with rotary + KV write fused in, no splits, as
        eager decode steps run it); 37 two-token rows (74 rows: cuBLAS beside the norm, rope and SiLU kernels on
        summed outputs, and the LM head at 37 rows)."""
        lay = self.layout
        longest = min(lay.max_tokens, lay.max_blocks * self.block_size)
        shapes = [(1, min(17, longest))]
        for num_seqs, q in ((3, 12), (37, 1), (37, 2)):
            if num_seqs <= lay.max_seqs and num_seqs * q <= lay.max_tokens and q <= longest:
                shapes.append((num_seqs, q))
        return shapes

    def release(self) -> None:
        """Drop the device memory this runner holds (the engine has stopped)."""
        self.graphs = None
        self.kv_cache = None
        self.model = None

    # ---- packing (CPU) ---------------------------------------------------------------------------
    def pack(self, batch: ScheduledBatch, prev: StepState | None) -> StepState:
        """Write batch's inputs into the free slot's pinned buffers; carry-over rows point into prev."""
        slot = self.pipeline.acquire_slot()
        st = StepState(batch, slot)
        prev_rows = prev.row_of if prev is not None else {}
        if batch.steady is not None:
            first = batch.num_steady_rows
            self._pack_steady(st, prev)
            if len(batch) > first:  # joiners of the run, by the general rules
                self._pack_mixed(st, prev_rows, first)
                self._write_block_tables(slot, batch.requests[first:], first)
            batch.steady.packed(st.sampled)
            return st
        if batch.is_decode_only:
            self._pack_decode(st, prev_rows)
        else:
            self._pack_mixed(st, prev_rows)
        self._write_block_tables(slot, batch.requests)
        return st

    def _pack_decode(self, st: StepState, prev_rows: dict[int, int]) -> None:
        """One token per request (the common step): each column built as a list, then one numpy copy."""
        h, bs, reqs = st.slot.np, self.block_size, st.batch.requests
        b = len(reqs)
        starts = [r.num_computed_tokens - 1 for r in reqs]
        token_carry = np.array([self._token_at(r, p, prev_rows) for r, p in zip(reqs, starts)], dtype=np.int64)
        h["input_ids"][:b] = token_carry[:, 0]
        h["carry_src"][:b] = token_carry[:, 1]
        pos = np.array(starts, dtype=np.int64)
        st.max_len = max(starts) + 1
        h["positions"][:b] = pos
        h["slot_mapping"][:b] = [r.block_ids[p // bs] * bs + p % bs for r, p in zip(reqs, starts)]
        h["seq_lens"][:b] = pos + 1
        h["query_start_loc"][:b + 1] = self._arange[:b + 1]
        if all(st.batch.samples):
            h["logits_idx"][:b] = self._arange[:b]
            st.sampled = list(reqs)
            st.row_of = {id(r): i for i, r in enumerate(reqs)}
        else:  # a one-token prefill chunk that is not its prompt's last token
            for i, (req, samples) in enumerate(zip(reqs, st.batch.samples)):
                if samples:
                    self._add_sampled(st, req, i)

    def _pack_steady(self, st: StepState, prev: StepState | None) -> None:
        """The steady batch's rows (the previous step's, less any that left), one token each: every column from
        its arrays."""
        h, bs, sb = st.slot.np, self.block_size, st.batch.steady
        n = len(sb)
        pos = sb.computed - 1  # (n,) the position each row feeds
        if prev is not None:  # still on the device: row i's input is the token it samples in row src_rows[i]
            h["input_ids"][:n] = 0
            h["carry_src"][:n] = sb.src_rows
        else:  # read already (synchronous mode): row i's input is the token the other slot read back there
            h["input_ids"][:n] = self.pipeline.other(st.slot).host_tokens.numpy()[sb.src_rows]
            h["carry_src"][:n] = -1
        h["positions"][:n] = pos
        h["slot_mapping"][:n] = sb.tables[sb.rows, pos // bs] * bs + pos % bs
        h["seq_lens"][:n] = sb.computed
        h["query_start_loc"][:n + 1] = self._arange[:n + 1]
        h["logits_idx"][:n] = self._arange[:n]
        width = int(sb.num_blocks.max())
        h["block_tables"][:n, :width] = sb.tables[:, :width]
        st.slot.table_owners[:n] = [None] * n  # the rows were written whole: the general path rewrites them
        st.max_len = int(sb.computed.max())
        st.sampled = list(sb.requests)
        st.row_of = dict(zip(map(id, st.sampled), range(n)))
        st.steady_version = sb.version

    def _pack_mixed(self, st: StepState, prev_rows: dict[int, int], first: int = 0) -> None:
        """Prefill chunks (every token known on the host) beside decode rows; from request `first` on (the ones
        before it are steady rows, one token each, packed already)."""
        h, bs, batch = st.slot.np, self.block_size, st.batch
        ids, pos, slots_, carry = h["input_ids"], h["positions"], h["slot_mapping"], h["carry_src"]
        qsl, seq_lens = h["query_start_loc"], h["seq_lens"]
        t = first  # each steady row before `first` feeds one token
        qsl[first] = t
        rows = zip(batch.requests[first:], batch.num_new_tokens[first:], batch.samples[first:])
        for b, (req, n, samples) in enumerate(rows, start=first):
            end = req.num_computed_tokens
            start = end - n
            blocks = req.block_ids
            if n == 1:
                ids[t], carry[t] = self._token_at(req, start, prev_rows)
                pos[t] = start
                slots_[t] = blocks[start // bs] * bs + start % bs
            else:  # a prefill chunk: every token is known on the host
                p = np.arange(start, end)
                ids[t:t + n] = req.token_slice(start, end)
                pos[t:t + n] = p
                carry[t:t + n] = -1
                slots_[t:t + n] = np.asarray(blocks)[p // bs] * bs + p % bs
            seq_lens[b] = end
            st.max_len = max(st.max_len, end)
            t += n
            qsl[b + 1] = t
            if samples:
                self._add_sampled(st, req, t - 1)

    @staticmethod
    def _add_sampled(st: StepState, req: Request, token_row: int) -> None:
        st.slot.np["logits_idx"][len(st.sampled)] = token_row
        st.row_of[id(req)] = len(st.sampled)
        st.sampled.append(req)

    @staticmethod
    def _write_block_tables(slot: Slot, reqs: list[Request], first: int = 0) -> None:
        """Row first + b of the slot's block table holds reqs[b]'s blocks; only blocks added since the slot last
        held that same list are written."""
        tables, owners = slot.np["block_tables"], slot.table_owners
        for b, req in enumerate(reqs, start=first):
            blocks = req.block_ids
            owner = owners[b]
            if owner is not None and owner[0] is blocks:
                if owner[1] < len(blocks):
                    tables[b, owner[1]:len(blocks)] = blocks[owner[1]:]
            else:
                tables[b, :len(blocks)] = blocks
            owners[b] = (blocks, len(blocks))

    def _token_at(self, req: Request, p: int, prev_rows: dict[int, int]) -> tuple[int, int]:
        """(token, carry source row): a token the host knows, or a placeholder taken from the previous step."""
        n_prompt = req.num_prompt_tokens
        if p < n_prompt:
            return req.prompt_token_ids[p], -1
        if p - n_prompt < len(req.output_token_ids):
            return req.output_token_ids[p - n_prompt], -1
        return 0, prev_rows[id(req)]  # sampled by the step still on the device

    def _pad_decode(self, slot: Slot, start: int, end: int) -> None:
        """Rows [start, end) of a graph bucket: one harmless token each, written into the null block."""
        h = slot.np
        h["input_ids"][start:end] = 0
        h["positions"][start:end] = 0
        h["slot_mapping"][start:end] = NULL_BLOCK * self.block_size
        h["carry_src"][start:end] = -1
        h["seq_lens"][start:end] = 1
        h["query_start_loc"][start + 1:end + 1] = np.arange(start + 1, end + 1)
        h["logits_idx"][start:end] = np.arange(start, end)
        h["block_tables"][start:end, 0] = NULL_BLOCK
        slot.table_owners[start:end] = [None] * (end - start)

    def _sampling(self, st: StepState, rows: int) -> SamplingTensors:
        """Fill the slot's sampling rows on the host; return the device views the sampler reads."""
        slot, reqs = st.slot, st.sampled
        n = len(reqs)
        S = self.layout.max_seqs
        host_f = slot.np["sampling_f"].reshape(6, S)
        host_i = slot.np["sampling_i"].reshape(2, S)
        host_k = slot.np["top_k"]
        params = [r.params for r in reqs]
        flags = fill_host_rows(params, [r.seed for r in reqs], [r.num_output_tokens - 1 for r in reqs],
                           host_f[:, :n], host_i[:, :n], host_k[:n])
        if rows > n:
            fill_padding_rows(host_f[:, n:rows], host_i[:, n:rows], host_k[n:rows])
        prompt = output = None
        if flags["any_penalty"]:
            prompt = pad_token_table([r.prompt_token_ids for r in reqs], rows, self.device)
            # outputs before this step's input token; the input token itself is appended on the device
            output = pad_token_table([r.output_token_ids[:max(0, r.num_computed_tokens - 1 - r.num_prompt_tokens)]
                                  for r in reqs], rows, self.device)
        dev_f = slot.dev["sampling_f"].view(6, S)[:, :rows]
        dev_i = slot.dev["sampling_i"].view(2, S)[:, :rows]
        tensors = assemble_tensors(dev_f, dev_i, slot.dev["top_k"][:rows], prompt, output, flags)
        st.read_logprobs = flags["num_logprobs"] >= 0
        st.num_top = max(0, flags["num_logprobs"])
        return tensors

    # ---- launch (queues GPU work) -----------------------------------------------------------------
    def launch(self, st: StepState, prev: StepState | None) -> None:
        batch, slot = st.batch, st.slot
        B, T = len(batch), batch.num_tokens
        bucket = None
        if self.graphs is not None and batch.is_decode_only and len(st.sampled) == B:
            bucket = self.graphs.bucket_for(B)
        if bucket is not None and bucket > B:
            self._pad_decode(slot, B, bucket)
        rows = bucket or len(st.sampled)
        max_len = st.max_len
        width = max(1, -(-max_len // self.block_size))  # block-table columns that hold context
        n_i32 = slot.i32_prefix + (bucket or B) * self.layout.max_blocks
        steady, first = batch.steady, batch.num_steady_rows
        if steady is not None:
            plain_greedy = steady.all_plain_greedy and all(r.plain_greedy for r in st.sampled[first:])
        else:
            plain_greedy = all(r.plain_greedy for r in st.sampled)
        if bucket is not None and plain_greedy:
            # the graph's argmax is every row's token: no sampling rows, stop-token bans or logprobs to prepare
            def replay_only() -> int:
                self.graphs.replay(slot, bucket, width, max_len)
                return rows

            self.pipeline.launch(slot, slot.host_i64.numel(), n_i32, 0, replay_only, False)
            return
        sampling = self._sampling(st, rows) if rows else None
        if bucket is not None and sampling.any_penalty:
            bucket = None  # penalty tables vary in width: run this step eagerly
            rows = len(st.sampled)
            sampling = self._sampling(st, rows)
        edits = logit_edits(st.sampled, self.device)
        prev_slot = self.pipeline.other(slot)
        has_carry = prev is not None and bool(prev.row_of)

        def compute() -> int:
            if bucket is not None:
                logits = self.graphs.replay(slot, bucket, width, max_len)  # carry-over + forward + logits
            else:
                logits = self._eager_forward(slot, B, T, width, max_len, max(batch.num_new_tokens),
                                             prev_slot if has_carry else None, len(st.sampled))
            if sampling is None:  # only partial prefill chunks: the step writes KV and samples nothing
                return 0
            if bucket is not None and edits is None and sampling.all_greedy and sampling.num_logprobs < 0:
                return rows  # the graph already wrote the greedy tokens into this slot's outputs
            if edits is not None:  # min_tokens bans, logit_bias, allowed_token_ids, bad_words
                edits.apply(logits, lambda: slot.dev["input_ids"][slot.dev["logits_idx"][:len(st.sampled)]])
            if sampling.any_penalty:
                self._append_input_tokens(slot, sampling, len(st.sampled))
            out = self.sampler(logits[:rows], sampling)
            slot.out_tokens[:rows].copy_(out.token_ids)
            if out.logprobs is not None:
                slot.out_logprobs[:rows].copy_(out.logprobs)
                slot.out_ranks[:rows].copy_(out.ranks)
            if out.top_ids is not None:
                k = out.top_ids.shape[1]
                slot.out_top_ids[:rows, :k].copy_(out.top_ids)
                slot.out_top_logprobs[:rows, :k].copy_(out.top_logprobs)
            return rows

        self.pipeline.launch(slot, slot.host_i64.numel(), n_i32, slot.host_f32.numel(), compute,
                             st.read_logprobs)

    def carry_over(self, slot: Slot, prev_slot: Slot | None, num_tokens: int) -> torch.Tensor:
        """Input ids with placeholders replaced by the previous step's sampled tokens (on the device)."""
        ids = slot.dev["input_ids"][:num_tokens]
        if prev_slot is None:
            return ids
        src = slot.dev["carry_src"][:num_tokens]  # (T,) row of the previous step, or -1
        carried = prev_slot.out_tokens[src.clamp(min=0)]  # (T,)
        ids.copy_(torch.where(src >= 0, carried, ids))  # in place: penalties read the final ids
        return ids

    def metadata(self, slot: Slot, num_seqs: int, num_tokens: int, width: int, max_query_len: int,
                 max_seq_len: int) -> AttentionMetadata:
        d = slot.dev
        return AttentionMetadata(
            slot_mapping=d["slot_mapping"][:num_tokens],
            query_start_loc=d["query_start_loc"][:num_seqs + 1],
            seq_lens=d["seq_lens"][:num_seqs],
            block_tables=d["block_tables"][:num_seqs, :width],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )

    def _eager_forward(self, slot: Slot, B: int, T: int, width: int, max_len: int, max_q: int,
                       prev_slot: Slot | None, num_sampled: int) -> torch.Tensor:
        ids = self.carry_over(slot, prev_slot, T)
        meta = self.metadata(slot, B, T, width, max_q, max_len)
        hidden = self.model(ids, slot.dev["positions"][:T], self.kv_cache, meta)  # (T, H)
        return self.model.compute_logits(hidden[slot.dev["logits_idx"][:num_sampled]])  # (N, V)

    def _append_input_tokens(self, slot: Slot, sampling: SamplingTensors, n: int) -> None:
        """Penalties count this step's input token (maybe carried over) as an output token when it is one."""
        out = sampling.output_token_ids  # (B, Lo) padded with -1
        idx = slot.dev["logits_idx"][:n]
        last = slot.dev["input_ids"][idx]  # (n,)
        is_output = slot.dev["positions"][idx] >= sampling.prompt_token_ids.ne(-1).sum(1)[:n]
        col = torch.where(is_output, last, torch.full_like(last, -1))
        pad = torch.full((out.shape[0], 1), -1, dtype=out.dtype, device=out.device)
        pad[:n, 0] = col
        sampling.output_token_ids = torch.cat([out, pad], dim=1)

    # ---- results (after the step's one wait) ------------------------------------------------------
    def read(self, st: StepState) -> StepResult:
        """Block on st's device-to-host event, then copy its tokens out of the pinned buffers."""
        self.pipeline.wait(st.slot)
        n = len(st.sampled)
        slot = st.slot
        result = StepResult(st.sampled, slot.host_tokens[:n].tolist())
        if st.read_logprobs:
            result.logprobs = slot.host_logprobs[:n].tolist()
            result.ranks = slot.host_ranks[:n].tolist()
            if st.num_top:
                result.top_ids = slot.host_top_ids[:n, :st.num_top].tolist()
                result.top_logprobs = slot.host_top_logprobs[:n, :st.num_top].tolist()
        return result
