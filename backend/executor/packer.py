"""Packing a scheduled step into a pipeline slot's pinned host buffers: token ids (or carry-over sources),
positions, KV slots, block tables, the rows whose logits are sampled, and the sampling settings of those rows."""
from __future__ import annotations

from itertools import islice

import numpy as np

from backend.core.kv_cache import NULL_BLOCK
from backend.core.scheduler import ScheduledBatch
from backend.core.running_batch import RunningBatch
from backend.executor.launch_plan import LaunchPlan
from backend.executor.logit_rules import LogitEdits, RowLogitEdits, step_logit_edits
from backend.executor.penalty_tokens import RowPenaltyTokens, outputs_before_input, prompt_tokens
from backend.executor.pipeline import Pipeline, Slot, SlotLayout
from backend.executor.sampler import SamplingTensors, fill_padding_rows, fill_request_rows, pad_token_table, \
    tensors_from_rows
from backend.executor.row_sampling import RowSamplingSettings, fill_plain_greedy_rows, merge_flags
from backend.request import Request
from backend.step_records import StepState


class SlotPacker:
    """Writes each step's inputs into the slot it takes from the pipeline; the CPU half of a step."""

    def __init__(self, pipeline: Pipeline, layout: SlotLayout, block_size: int, device) -> None:
        self.pipeline = pipeline
        self.layout = layout
        self.block_size = block_size
        self.device = device
        self._arange = np.arange(layout.max_seqs + 1)  # query_start_loc and logits_idx of decode-only steps
        self._row_sampling = RowSamplingSettings()  # the decode rows' settings, following the rows' changes
        self._row_edits = RowLogitEdits()  # the decode rows' fixed logit edits, following them too
        self._row_tokens = RowPenaltyTokens()  # the decode rows' prompt and output tokens, for penalties

    def pack(self, batch: ScheduledBatch, prev: StepState | None) -> StepState:
        """Write batch's inputs into the free slot's pinned buffers; carry-over rows point into prev."""
        slot = self.pipeline.acquire_slot()
        st = StepState(batch, slot)
        padding, slot.decode_padding = slot.decode_padding, None  # this pack writes over rows of it
        first = batch.num_rows
        self._pack_rows(st, prev)
        if len(batch) > first:  # prefill chunks (and prefilled requests not rows yet) after the rows
            self._pack_chunks(st, prev, first)
            slot.arange_rows = first  # rows [0, first] still hold the rows' offsets; the chunks' follow
            self._write_block_tables(slot, batch.requests[first:], first)
        elif padding is not None and first < padding[1]:  # the rows wrote rows [0, first) only
            slot.decode_padding = (max(first, padding[0]), padding[1])
        batch.rows.packed(st.sampled)
        return st

    def _pack_rows(self, st: StepState, prev: StepState | None) -> None:
        """The running batch's decode rows, one token each: every column from its arrays."""
        slot, rb, n = st.slot, st.batch.rows, st.batch.num_rows
        st.sampled = list(rb.requests)
        st.rows_version = rb.version
        if not n:
            return
        h = slot.np
        if prev is not None:  # still on the device: row i's input is the token it samples in row src_rows[i]
            h["carry_src"][:n] = rb.src_rows  # every row carries over: its input_ids entry is never read
        else:  # read already (synchronous mode): row i's input is the token the other slot read back there
            h["input_ids"][:n] = self.pipeline.other(st.slot).host_tokens.numpy()[rb.src_rows]
            h["carry_src"][:n] = -1
        np.subtract(rb.computed, 1, out=h["positions"][:n])  # the position each row feeds
        h["slot_mapping"][:n] = rb.kv_slots
        h["seq_lens"][:n] = rb.computed
        if slot.arange_rows < n:  # one row, one token, one logits row each
            h["query_start_loc"][:n + 1] = self._arange[:n + 1]
            h["logits_idx"][:n] = self._arange[:n]
            slot.arange_rows = n
        self._write_row_tables(slot, rb)

    @staticmethod
    def _write_row_tables(slot: Slot, sb: RunningBatch) -> None:
        """The decode rows' block tables into the slot's rows [0, rows): whole rows only where the slot holds another
        row's (a row moved into a deleted one's place, a row that joined), else the blocks added since the slot was
        last packed (two steps ago: a block at most per row)."""
        n, tables, held = len(sb), slot.np["block_tables"], slot.row_tables
        if held is None or held[0] != sb.serial:
            held = slot.row_tables = (sb.serial, np.full(len(tables), -1, dtype=np.int64),
                                         np.zeros(len(tables), dtype=np.int64))
        ids, counts = held[1][:n], held[2][:n]  # views: written below
        moved = (ids != sb.table_ids).nonzero()[0]
        if moved.size > n // 2:  # most rows changed in this slot: every row, gathered straight into the slot (the
            # store's width is the slot's); mode="clip" because with out= numpy's default bounds mode gathers into a
            # temporary first, and every table row index is in range
            np.take(sb.table_store, sb.table_rows, axis=0, out=tables[:n], mode="clip")
            slot.table_owners[:n] = [None] * n  # written whole: a prefill row placed here later rewrites it
        else:
            if moved.size:
                tables[moved] = sb.table_store[sb.table_rows[moved]]
                for row in moved.tolist():
                    slot.table_owners[row] = None
                counts[moved] = sb.num_blocks[moved]
            grown = (counts != sb.num_blocks).nonzero()[0]
            if grown.size:
                if (sb.num_blocks[grown] - counts[grown]).max() == 1:
                    cols = counts[grown]
                    tables[grown, cols] = sb.table_store[sb.table_rows[grown], cols]
                else:
                    tables[grown] = sb.table_store[sb.table_rows[grown]]
        ids[:] = sb.table_ids
        counts[:] = sb.num_blocks

    def _pack_chunks(self, st: StepState, prev: StepState | None, first: int) -> None:
        """Prefill chunks (every token known on the host) and prefilled requests' one-token steps, from request
        `first` on (the ones before it are decode rows, one token each, packed already)."""
        h, bs, batch = st.slot.np, self.block_size, st.batch
        ids, pos, slots_, carry = h["input_ids"], h["positions"], h["slot_mapping"], h["carry_src"]
        qsl, seq_lens = h["query_start_loc"], h["seq_lens"]
        t = first  # each decode row before `first` feeds one token
        qsl[first] = t
        rows = zip(batch.requests[first:], batch.num_new_tokens[first:], batch.samples[first:])
        for b, (req, n, samples) in enumerate(rows, start=first):
            end = req.num_computed_tokens
            start = end - n
            blocks = req.block_ids
            if n == 1:
                ids[t], carry[t] = self._token_at(req, start, prev)
                pos[t] = start
                slots_[t] = blocks[start // bs] * bs + start % bs
            else:  # a prefill chunk: every token is known on the host
                p = np.arange(start, end)
                prompt = req.prompt_array
                # a prompt's chunk from its array (made off the loop): no list of ints converted here
                ids[t:t + n] = prompt[start:end] if prompt is not None and end <= req.num_prompt_tokens \
                    else req.token_slice(start, end)
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
        st.sampled.append(req)

    @staticmethod
    def _write_block_tables(slot: Slot, reqs: list[Request], first: int = 0) -> None:
        """Row first + b of the slot's block table holds reqs[b]'s blocks; only blocks added since the slot last
        held that same list are written."""
        tables, owners = slot.np["block_tables"], slot.table_owners
        if slot.row_tables is not None:  # these rows hold no decode row's blocks now
            slot.row_tables[1][first:first + len(reqs)] = -1
        for b, req in enumerate(reqs, start=first):
            blocks = req.block_ids
            owner = owners[b]
            if owner is not None and owner[0] is blocks:
                if owner[1] < len(blocks):
                    tables[b, owner[1]:len(blocks)] = blocks[owner[1]:]
            else:
                tables[b, :len(blocks)] = blocks
            owners[b] = (blocks, len(blocks))

    def _token_at(self, req: Request, p: int, prev: StepState | None) -> tuple[int, int]:
        """(token, carry source row): a token the host knows, or a placeholder taken from the previous step."""
        n_prompt = req.num_prompt_tokens
        if p < n_prompt:
            return req.prompt_token_ids[p], -1
        if p - n_prompt < len(req.output_token_ids):
            return req.output_token_ids[p - n_prompt], -1
        return 0, prev.row_of[id(req)]  # sampled by the step still on the device

    def pad(self, st: StepState, plan: LaunchPlan) -> None:
        """The padding the step's graph reads: one-token rows up to a decode graph's bucket, or a mixed graph's
        tokens, sequences and logits rows past the step's own."""
        batch = st.batch
        if plan.bucket is not None and plan.bucket > len(batch):
            self.pad_decode(st.slot, len(batch), plan.bucket)
        elif plan.tokens is not None:
            self.pad_mixed(st.slot, len(batch), batch.num_tokens, plan.tokens, len(st.sampled), plan.logits_rows)

    def pad_decode(self, slot: Slot, start: int, end: int) -> None:
        """Rows [start, end) of a graph bucket: one harmless token each, written into the null block (unless the
        slot's host buffers hold that padding still: the decode rows' count moves by a few rows a step)."""
        padding = slot.decode_padding
        if padding is not None and padding[0] <= start and end <= padding[1]:
            return
        slot.decode_padding = (start, end)
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
        if slot.row_tables is not None:
            slot.row_tables[1][start:end] = -1

    def pad_mixed(self, slot: Slot, num_seqs: int, num_tokens: int, tokens: int, num_sampled: int, rows: int) -> None:
        """A mixed graph's padding: tokens [num_tokens, tokens) written into the null block and in no sequence,
        sequence slots from num_seqs on empty, logits rows [num_sampled, rows) read from token 0."""
        h, S = slot.np, self.layout.max_seqs
        h["input_ids"][num_tokens:tokens] = 0
        h["positions"][num_tokens:tokens] = 0
        h["slot_mapping"][num_tokens:tokens] = NULL_BLOCK * self.block_size
        h["carry_src"][num_tokens:tokens] = -1
        h["query_start_loc"][num_seqs + 1:S + 1] = num_tokens
        h["seq_lens"][num_seqs:S] = 1
        h["logits_idx"][num_sampled:rows] = 0

    def device_rows(self, slot: Slot, rows: int, top_k: bool = True) -> SamplingTensors:
        """The device views of a slot's leading sampling rows as they stand, every flag on but top-k's as given (for
        a captured sampler: the fused kernel reads each row's settings and ignores the flags but these)."""
        flags = dict(all_greedy=False, any_top_k=top_k, any_top_p=True, any_min_p=True, any_penalty=False,
                     num_logprobs=-1)
        return tensors_from_rows(slot.sampling_views(rows), None, None, flags)

    def logit_edits(self, st: StepState) -> LogitEdits | None:
        """The step's logit edits on the device (min_tokens bans, logit_bias, allowed_token_ids, bad_words); None
        when no sampled row has any."""
        return step_logit_edits(self._row_edits, st.batch.rows, st.sampled, self.device)

    def sampling_rows(self, st: StepState, rows: int) -> SamplingTensors:
        """Fill the slot's sampling rows on the host; return the device views the sampler reads."""
        slot, reqs = st.slot, st.sampled
        n, first = len(reqs), st.batch.num_rows  # the decode rows lead the step's sampled rows, as packed
        host_f, host_i, host_k = slot.sampling_host
        flags = self._row_sampling.fill(st.batch.rows, host_f[:, :first], host_i[:, :first], host_k[:first]) \
            if first else None
        if n > first:  # the prefill rows that sample
            if all(r.plain_greedy for r in islice(reqs, first, None)):  # they sample alike: nothing to read
                more = fill_plain_greedy_rows(host_f[:, first:n], host_i[:, first:n], host_k[first:n])
            else:
                more = fill_request_rows(reqs[first:], host_f[:, first:n], host_i[:, first:n], host_k[first:n])
            flags = more if flags is None else merge_flags(flags, more)
        if rows > n:
            fill_padding_rows(host_f[:, n:rows], host_i[:, n:rows], host_k[n:rows])
        prompt = output = None
        if flags["any_penalty"]:  # the decode rows' tables kept per row; the prefill rows' read from them
            prompts, outputs = self._row_tokens.tables(st.batch.rows) if first else ([], [])
            prompts += [prompt_tokens(r) for r in reqs[first:]]
            outputs += [np.asarray(r.output_token_ids[:outputs_before_input(r)], dtype=np.int64) for r in reqs[first:]]
            prompt = pad_token_table(prompts, rows, self.device)
            output = pad_token_table(outputs, rows, self.device)
        tensors = tensors_from_rows(slot.sampling_views(rows), prompt, output, flags)
        st.read_logprobs = flags["num_logprobs"] >= 0
        st.num_top = max(0, flags["num_logprobs"])
        return tensors
