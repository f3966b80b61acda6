"""A step whose decode rows carry drafted tokens: its packed inputs widened (each row's drafts after its token), one
eager forward with logits at every drafted position, every position sampled as the row's later steps would be
(verify.expand_rows), and all of them read back. The forward replays a mixed or verify graph for the step's token
count where one holds its logits rows (graphs.py), else it runs eagerly; the sampling is eager."""
from __future__ import annotations

import numpy as np
import torch

from backend.executor.runner import ModelRunner
from backend.executor.sampler import host_to_device
from backend.speculative.speculator import StepDrafts
from backend.speculative.verify import expand_rows
from backend.step_records import StepResult, StepState

_TOKEN_COLUMNS = ("input_ids", "positions", "slot_mapping", "carry_src")


class DraftedSteps:
    """Launches and reads the runner's steps that carry drafts (the synchronous pipeline: nothing carries over)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def launch(self, st: StepState, drafts: StepDrafts) -> None:
        """Widen st's packed inputs by its drafts, then queue its forward and its sampling of every position."""
        r, slot, batch = self.runner, st.slot, st.batch
        starts = drafts.starts()
        rows = starts[-1] + 1 + len(drafts.drafts[-1])
        max_len = self._widen(st, drafts, starts)
        greedy = r.all_plain_greedy(st)  # every position's token is its argmax: nothing to expand or edit
        sampling = None if greedy else r.packer.sampling_rows(st, len(st.sampled))  # expanded on the device
        edits = None if greedy else r.packer.logit_edits(st)
        tokens = batch.num_tokens + drafts.num_drafted
        width = -(-max_len // r.block_size)
        longest_query = max(max(batch.num_new_tokens), max(drafts.counts))
        graph = r.graphs.verify_bucket_for(tokens, rows) if r.graphs is not None else None
        if graph is not None:
            r.packer.pad_mixed(slot, len(batch), tokens, graph[1], rows, r.graphs.verify_logits_rows(graph))

        def forward() -> tuple[bool, float | None]:
            if graph is not None:
                st.logits = r.graphs.replay_verify(slot, graph)
                return not r.graphs.eager, r.graphs.idle_of(graph)
            st.logits = r._eager_forward(slot, len(batch), tokens, width, max_len, longest_query, None, rows)
            return False, 0.0

        def sample() -> tuple[int, bool, float]:
            logits = st.logits[:rows]  # a graph's padding rows past them
            if greedy:
                r.step_ops.mixed.greedy_argmax(logits, slot.targets.tokens[:rows])
                return rows, False, 0.0
            firsts = host_to_device(np.asarray(starts, dtype=np.int64), logits.device)  # each row's first position
            if sampling.any_penalty:  # a position's outputs: the row's, its input token, the drafts before it
                r.append_input_tokens(slot, sampling, len(starts), firsts)
            if edits is not None:  # rows with edits draft nothing: their one position is their first
                own = logits[firsts]
                edits.apply(own, lambda: slot.dev["input_ids"][slot.dev["logits_idx"][firsts]])
                logits[firsts] = own
            if batch.rows.any_constrained or any(req.grammar is not None for req in st.sampled[batch.num_rows:]):
                # after the edits, as on one-token steps: a grammar's ban stands whatever a bias adds
                r.grammar_masks.apply_drafted(logits, st.sampled, drafts.drafts, slot.index)
            r.sampler.sample_into(logits, expand_rows(sampling, drafts.counts, drafts.drafts), slot.targets)
            return rows, False, 0.0

        r.pipeline.launch_forward(slot, slot.i32_prefix + len(batch) * r.layout.max_blocks, forward)
        r.pipeline.launch_sampling(slot, sample, st.read_logprobs)

    @staticmethod
    def _widen(st: StepState, drafts: StepDrafts, starts: list[int]) -> int:
        """Rewrite the slot's token columns: decode row i's token at starts[i], its drafts after it, the prefill
        chunks after all rows; every drafted position a logits row. Returns the longest context."""
        slot, batch, rb = st.slot, st.batch, st.batch.rows
        h, bs = slot.np, rb.block_size
        n, T, D, B = batch.num_rows, batch.num_tokens, drafts.num_drafted, len(batch)
        m = len(st.sampled)
        for name in _TOKEN_COLUMNS:  # the chunks' tokens move past the drafts
            h[name][n + D:T + D] = h[name][n:T].copy()
        prefill_logits = h["logits_idx"][n:m] + D
        lengths = np.array([1 + len(d) for d in drafts.drafts[:n]], dtype=np.int64)
        row_starts = np.asarray(starts[:n], dtype=np.int64)
        within = np.arange(n + D) - np.repeat(row_starts, lengths)
        positions = np.repeat(h["positions"][:n], lengths) + within
        ids = np.repeat(h["input_ids"][:n], lengths)
        for i, guess in enumerate(drafts.drafts[:n]):
            if guess:
                ids[starts[i] + 1:starts[i] + 1 + len(guess)] = guess
        blocks = rb.table_store[np.repeat(rb.table_rows, lengths), positions // bs]
        h["input_ids"][:n + D] = ids
        h["positions"][:n + D] = positions
        h["slot_mapping"][:n + D] = blocks.astype(np.int64) * bs + positions % bs
        h["carry_src"][:n + D] = -1
        h["seq_lens"][:n] = rb.computed + lengths - 1
        qsl = h["query_start_loc"]
        qsl[n + 1:B + 1] += D
        qsl[:n] = row_starts
        qsl[n] = n + D
        h["logits_idx"][n + D:m + D] = prefill_logits
        h["logits_idx"][:n + D] = np.arange(n + D)
        # why: the packer's shortcuts assume one token per row; the next pack writes these rows whole
        slot.arange_rows = 0
        slot.decode_padding = None
        return max(st.max_len, int(h["seq_lens"][:n].max()))

    def read(self, st: StepState, drafts: StepDrafts) -> StepResult:
        """Block until the step's outputs are on the host: every position's token (and logprobs when asked)."""
        return self.runner.read(st, sum(drafts.counts))

    @staticmethod
    def leave_last_tokens(st: StepState, last: list[int]) -> None:
        """Each sampled row's last emitted token at its row of the slot's host tokens, where the next (synchronous)
        pack reads a row's input, as after a step of one token per row."""
        st.slot.host_tokens[:len(last)] = torch.tensor(last, dtype=torch.int64)
