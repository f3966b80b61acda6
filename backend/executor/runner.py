"""Runs a packed step on the device (carry-over + forward + logit edits + sampling) and reads its results back."""
from __future__ import annotations

import torch

from backend.core.scheduler import ScheduledBatch
from backend.executor.grammar_masks import GrammarMasks
from backend.executor.graphs import DecodeGraphs
from backend.executor.launch_plan import LaunchPlan
from backend.executor.packer import SlotPacker
from backend.step_records import StepResult, StepState
from backend.executor.pipeline import Pipeline, Slot, SlotLayout
from backend.executor.sampler import Sampler, SamplingTensors
from backend.executor.step_ops import StepOps
from backend.ops.attention_metadata import AttentionMetadata
from backend.runtime.timeline import Timeline


class ModelRunner:
    """Owns the KV cache, the slots' contents and the model call of every step."""

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, layout: SlotLayout,
                 device: torch.device, timeline: Timeline, use_graphs: bool, max_graph_batch: int,
                 fused_sampler: bool = True, mixed_graphs: bool = True, step_ops: StepOps | None = None) -> None:
        self.model = model
        self.step_ops = step_ops or StepOps.uniform(model.ops)  # the op set each kind of step launches with
        self.kv_cache = kv_cache  # (L, 2, NB, BS, Hkv, D)
        self.block_size = block_size
        self.layout = layout
        self.device = device
        self.timeline = timeline
        self.pipeline = Pipeline(layout, device, timeline)
        self.sampler = Sampler(model.ops.sample_rows if fused_sampler else None)
        self.vocab_size = model.spec.vocab_size
        self.grammar_masks = GrammarMasks(self.vocab_size, pinned=device.type == "cuda")
        self.sampler.vocab_hash(self.vocab_size, device)  # cached before any graph capture
        self.packer = SlotPacker(self.pipeline, layout, block_size, device)
        self.graphs: DecodeGraphs | None = None
        if use_graphs:  # without CUDA: the same decode-graph step, run eagerly
            fused = self.sample_every_row if self.sampler.fused is not None else None
            # mixed steps in graphs need the attention kernel that finds its sequences on the device (Triton's)
            mixed = self.mixed_forward if mixed_graphs and model.ops.name.startswith("triton") else None
            self.graphs = DecodeGraphs(self.decode_forward, self.pipeline, device, layout, block_size,
                                       model.spec, max_graph_batch, fused, mixed)

    def prepare(self, measure_graph_idle: bool = True) -> None:
        """Warm the eager forward up and capture the decode graphs, before the first request; then, unless told
        not to, time the idle inside each graph (graph_idle.py) for the GPU-busy figures."""
        if self.device.type == "cuda" or self.model.ops.name.startswith("triton"):
            # before the capture, whose own warm-up resets the inputs it reads; wherever Triton kernels run, also
            # under Triton's CPU interpreter, so the CPU tests run the warm-up's steps too
            self.warm_up_prefill()
        if self.graphs is not None:
            self.graphs.capture_all()
            if measure_graph_idle:
                self.graphs.measure_idle()

    def decode_forward(self, slot: Slot, prev_slot: Slot | None, bucket: int, width: int, max_len: int,
                       logits_out: torch.Tensor | None) -> torch.Tensor:
        """A decode step's device work (what a decode graph holds): carry-over, forward, logits, greedy pick."""
        ids = self.carry_over(slot, prev_slot, bucket)
        meta = self.metadata(slot, bucket, bucket, width, 1, max_len)
        ops = self.step_ops.decode(bucket)
        hidden = self.model(ids, slot.dev["positions"][:bucket], self.kv_cache, meta, ops)  # (bucket, H)
        logits = self.model.compute_logits(hidden, logits_out, ops)  # (bucket, V)
        ops.greedy_argmax(logits, slot.out_tokens[:bucket])  # greedy tokens, final for all-greedy steps
        return logits

    def mixed_forward(self, slot: Slot, prev_slot: Slot | None, tokens: int, rows: int,
                      logits_out: torch.Tensor | None) -> torch.Tensor:
        """A mixed step's device work (what a mixed graph holds): carry-over, forward over `tokens` tokens in every
        sequence slot of the layout (the step's own first; the rest hold no tokens), logits of `rows` rows."""
        ids = self.carry_over(slot, prev_slot, tokens)
        lay = self.layout
        # max_query_len > 1 takes the attention kernel that reads query lengths on the device
        meta = self.metadata(slot, lay.max_seqs, tokens, lay.max_blocks, max(2, tokens), lay.max_blocks * self.block_size)
        ops = self.step_ops.mixed
        hidden = self.model(ids, slot.dev["positions"][:tokens], self.kv_cache, meta, ops)  # (tokens, H)
        return self.model.compute_logits(hidden[slot.dev["logits_idx"][:rows]], logits_out, ops)  # (rows, V)

    def sample_every_row(self, slot: Slot, bucket: int, logits: torch.Tensor, top_k: bool) -> None:
        """A sampling graph's body: the fused sampler over a bucket's rows, every setting read from the slot's
        device buffers (padding rows are greedy), so one capture serves any mix of settings (top_k=False: any
        without top-k)."""
        self.sampler.sample_into(logits, self.packer.device_rows(slot, bucket, top_k), slot.targets)

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
            slot.forget_tables()  # so the next pack writes whole block-table rows
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

    def pack(self, batch: ScheduledBatch, prev: StepState | None) -> StepState:
        """Write batch's inputs into the free slot's pinned buffers; carry-over rows point into prev."""
        return self.packer.pack(batch, prev)

    def reset_slots(self) -> None:
        """After a failed step (the device synchronized): both slots are free for the next step."""
        for slot in self.pipeline.slots:
            slot.in_use = False

    def release(self) -> None:
        """Drop the device memory this runner holds (the engine has stopped)."""
        self.graphs = None
        self.kv_cache = None
        self.model = None

    # ---- launch (queues GPU work) -----------------------------------------------------------------
    def launch_forward(self, st: StepState, prev: StepState | None) -> None:
        """Plan the step, have its padding packed, and queue its inputs' copy and its forward. Its sampling is a
        second launch (launch_sampling), so the loop may read the step before and do per-row host work between."""
        plan = st.plan = self.plan(st)
        self.packer.pad(st, plan)
        prev_slot = self.pipeline.other(st.slot) if prev is not None and prev.sampled else None
        n_i32 = st.slot.i32_prefix + (plan.bucket or len(st.batch)) * self.layout.max_blocks
        self.pipeline.launch_forward(st.slot, n_i32, lambda: self._forward(st, plan, prev_slot))

    def launch_sampling(self, st: StepState, deferred: bool = False) -> None:
        """Queue the step's logit edits and sampling after its forward, then the copy of its tokens back; deferred:
        host work ran since the forward was queued (the GPU may have waited between them)."""
        self.pipeline.launch_sampling(st.slot, lambda: self._sample(st, st.plan), st.read_logprobs, deferred)

    def plan(self, st: StepState) -> LaunchPlan:
        """The one place that decides how a step runs: a decode graph where one fits, else a mixed graph for its
        token count, else the eager forward (always with penalties: their tables vary in width); the sampler's rows
        and settings, the logit edits, and whether a grammar masks rows (then the sampling waits for the step
        before's tokens: sample_after_previous)."""
        n = len(st.sampled)
        bucket = self._graph_bucket(st)
        tokens = None if bucket is not None else self._mixed_bucket(st)
        logits_rows = self.graphs.logits_rows(tokens) if tokens is not None else 0
        if bucket is not None and self.all_plain_greedy(st):  # no sampling rows, bans or logprobs to prepare
            return LaunchPlan(bucket, None, bucket, 0, None, None, *self._context(st, graph=True), argmax_only=True)
        rows = bucket or (self._sampler_rows(n, tokens) if tokens is not None else n)
        sampling = self.packer.sampling_rows(st, rows) if n else None
        if sampling is not None and sampling.any_penalty and (bucket or tokens):
            bucket = tokens = None
            rows = n
            sampling = self.packer.sampling_rows(st, rows)
        edits = self.packer.logit_edits(st)
        graph = bucket is not None or tokens is not None
        constrained = n > 0 and self._any_constrained(st)
        st.sample_after_previous = st.sample_after_previous or constrained
        return LaunchPlan(bucket, tokens, rows, logits_rows, sampling, edits, *self._context(st, graph),
                          constrained=constrained)

    def _forward(self, st: StepState, plan: LaunchPlan, prev_slot: Slot | None) -> tuple[bool, float | None]:
        """Queue the forward (carry-over, model, logits, and a decode graph's argmax); returns (whether it was a
        graph replay, the idle seconds inside that graph or None where not measured)."""
        slot, batch = st.slot, st.batch
        if plan.bucket is not None:
            st.logits = self.graphs.replay(slot, plan.bucket, plan.width, plan.max_len)
            return not self.graphs.eager, self.graphs.idle_of(("decode", plan.bucket))
        if plan.tokens is not None:  # the same, for prefill chunks beside decode rows
            st.logits = self.graphs.replay_mixed(slot, plan.tokens)
            return not self.graphs.eager, self.graphs.idle_of(("mixed", plan.tokens))
        st.logits = self._eager_forward(slot, len(batch), batch.num_tokens, plan.width, plan.max_len,
                                        max(batch.num_new_tokens), prev_slot, len(st.sampled))
        return False, 0.0

    def _sample(self, st: StepState, plan: LaunchPlan) -> tuple[int, bool, float | None]:
        """Queue the logit edits and the sampler over the forward's logits; returns (rows sampled, whether that was
        graph replays or nothing, the idle seconds inside those graphs or None where not measured)."""
        sampling, slot, rows = plan.sampling, st.slot, plan.rows
        if plan.argmax_only:  # the decode graph wrote every row's token
            return rows, True, 0.0
        if sampling is None:  # only partial prefill chunks: the step writes KV and samples nothing
            return 0, True, 0.0
        if plan.graph and plan.edits is None and sampling.num_logprobs < 0 and not plan.constrained:
            if plan.bucket is not None and sampling.all_greedy:
                return rows, True, 0.0  # the graph already wrote the greedy tokens into this slot's outputs
            if self.graphs.samples and self.graphs.has_sampler(slot, rows):  # the fused sampler, captured
                self.graphs.replay_sampler(slot, rows, sampling.any_top_k)
                return rows, True, self.graphs.idle_of(("sampler", rows, sampling.any_top_k))
        n = len(st.sampled)
        if plan.edits is not None:
            plan.edits.apply(st.logits, lambda: slot.dev["input_ids"][slot.dev["logits_idx"][:n]])
        if plan.constrained:  # after the edits: a grammar's ban stands whatever a bias adds
            self.grammar_masks.apply(st.logits[:n], st.sampled, slot.index)
        if sampling.any_penalty:
            self.append_input_tokens(slot, sampling, n)
        self.sampler.sample_into(st.logits[:rows], sampling, slot.targets)
        return rows, False, 0.0

    def _context(self, st: StepState, graph: bool) -> tuple[int, int]:
        """(block-table columns that hold context, longest context) of a step, which only eager forwards read (a
        captured graph reads the whole block table: (0, 0))."""
        if graph and not self.graphs.eager:
            return 0, 0
        max_len = st.longest_context()
        return max(1, -(-max_len // self.block_size)), max_len

    def _mixed_bucket(self, st: StepState) -> int | None:
        """The mixed graph's token bucket for a step no decode graph takes; None: the step runs eagerly."""
        if self.graphs is None or not self.graphs.token_buckets:
            return None
        return self.graphs.token_bucket_for(st.batch.num_tokens)

    def _sampler_rows(self, n: int, tokens: int) -> int:
        """Rows a mixed step samples: a sampler graph's bucket when one holds n rows within the graph's logits."""
        rows = self.graphs.bucket_for(n) if self.graphs.samples else None
        return rows if rows is not None and rows <= self.graphs.logits_rows(tokens) else n

    def _graph_bucket(self, st: StepState) -> int | None:
        """The decode graph's batch bucket for a decode-only step that samples every row; None: no decode graph."""
        batch = st.batch
        if self.graphs is None or not batch.is_decode_only or len(st.sampled) != len(batch):
            return None
        return self.graphs.bucket_for(len(batch))

    @staticmethod
    def _any_constrained(st: StepState) -> bool:
        """Some sampled row follows a grammar: the decode rows' count is kept; the prefill rows are few."""
        return st.batch.rows.any_constrained or any(r.grammar is not None for r in st.sampled[st.batch.num_rows:])

    @staticmethod
    def all_plain_greedy(st: StepState) -> bool:
        """Every sampled row is plain greedy: the decode rows' count of other rows is kept; the prefill rows are
        few."""
        return st.batch.rows.all_plain_greedy and all(r.plain_greedy for r in st.sampled[st.batch.num_rows:])

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
        ops = self.step_ops.decode(B) if max_q == 1 else self.step_ops.mixed
        hidden = self.model(ids, slot.dev["positions"][:T], self.kv_cache, meta, ops)  # (T, H)
        return self.model.compute_logits(hidden[slot.dev["logits_idx"][:num_sampled]], None, ops)  # (N, V)

    def append_input_tokens(self, slot: Slot, sampling: SamplingTensors, n: int,
                            firsts: torch.Tensor | None = None) -> None:
        """Penalties count this step's input token (maybe carried over) as an output token when it is one; firsts:
        each of the n sampled rows' logits row (default 0 .. n - 1; a drafting row's first position)."""
        out = sampling.output_token_ids  # (B, Lo) padded with -1
        idx = slot.dev["logits_idx"][:n] if firsts is None else slot.dev["logits_idx"][firsts]
        last = slot.dev["input_ids"][idx]  # (n,)
        is_output = slot.dev["positions"][idx] >= sampling.prompt_token_ids.ne(-1).sum(1)[:n]
        col = torch.where(is_output, last, torch.full_like(last, -1))
        pad = torch.full((out.shape[0], 1), -1, dtype=out.dtype, device=out.device)
        pad[:n, 0] = col
        sampling.output_token_ids = torch.cat([out, pad], dim=1)

    # ---- results (after the step's one wait) ------------------------------------------------------
    def read(self, st: StepState, rows: int | None = None) -> StepResult:
        """Block on st's device-to-host event, then copy its tokens out of the pinned buffers: one per sampled row,
        or the first `rows` (a step whose rows sampled several positions)."""
        self.pipeline.wait(st.slot)
        n = len(st.sampled) if rows is None else rows
        slot = st.slot
        result = StepResult(st.sampled, slot.host_tokens[:n].tolist())
        if st.read_logprobs:
            result.logprobs = slot.host_logprobs[:n].tolist()
            result.ranks = slot.host_ranks[:n].tolist()
            if st.num_top:
                result.top_ids = slot.host_top_ids[:n, :st.num_top].tolist()
                result.top_logprobs = slot.host_top_logprobs[:n, :st.num_top].tolist()
        return result
