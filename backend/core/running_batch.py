"""The running batch: every running request, its decode rows kept in arrays updated in place, step after step.

A request admitted to run first prefills (its prompt chunks, by the scheduler's token budget); once its prompt is
done and a step has sampled its first token it becomes a decode row, feeding one token a step. The rows' KV
positions, block tables, limits and token counts live in numpy arrays, so the scheduler, the packer and the step
update each work on all rows at once: the per-request Python left is one short loop when a step's tokens arrive
(each row's token appended to its request). While a request is a row the batch counts its tokens for it (one add a
step for every row); the request's own counters read the batch (Request.num_computed_tokens), so they are always
right.

Rows change as requests come and go: a request that finishes, is preempted or reaches its length limit leaves as a
deleted row, whose place the last row takes (so one row moves, and a slot rewrites one block-table row, not those of
every row after it); prefilled requests join at the end. Each change is published in a short log (`changes`: rows
taken in a new order, rows appended), which per-row state kept elsewhere follows without reading every request (the
sampling settings: executor/row_sampling.py; a slot's block tables: executor/packer.py). The next step's carry-over
reads each row's token from its old row of the step before (`src_rows`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import compress, count

import numpy as np

from backend.request import Request

_KEPT_CHANGES = 8  # row changes remembered (RunningBatch.changes): a step's rows change a few times at most
_SERIALS = count()  # each running batch's number, so state kept about one (a slot's block tables) names it
# a row whose token count, as it stands when a step's update runs, is this close to its token cap may end by length
# there, so that update checks it token by token (the plain and the drafted update alike): one for the token the step
# sampled, one of slack
LENGTH_MARGIN = 2


@dataclass(slots=True)
class PackedRows:
    """The decode rows as one step was packed from them: what that step's update needs, whatever changed since."""

    streamed_rows: list[int]
    streamed_ids: list[str]
    appends: list  # each row's output_token_ids.append
    stop_ids: frozenset
    computed: np.ndarray  # (rows,) tokens counted, this step's included (a copy: the batch's columns change in place)
    token_cap: np.ndarray  # (rows,) a copy too
    checked_rows: np.ndarray | None  # rows the update checks every step (logprobs to report); None: none

    def rows_that_may_end(self, tokens: list[int]) -> np.ndarray:
        """Rows whose token this step the update must check one by one: near a length limit, a token that is one of
        any row's stop tokens, or a row whose every token is checked."""
        # these counts predate the next step's token, which the loop (one step ahead) has counted by the update
        risky = self.computed + 1 + LENGTH_MARGIN >= self.token_cap
        if not self.stop_ids.isdisjoint(tokens):
            risky |= np.isin(np.asarray(tokens), np.fromiter(self.stop_ids, dtype=np.int64))
        if self.checked_rows is not None:
            risky[self.checked_rows] = True
        return risky.nonzero()[0]

    def accept(self, tokens: list[int], keep: list[bool] | None = None) -> None:
        """Each row's token (with keep: of the rows it marks) appended to its request's outputs."""
        pairs = zip(self.appends, tokens) if keep is None else compress(zip(self.appends, tokens), keep)
        for append, tok in pairs:
            append(tok)

    def events(self, tokens: list[int], keep: list[bool] | None = None) -> list[tuple[str, int]]:
        """(request_id, token) for each streamed row (with keep: of the rows it marks), made into outputs by the
        output thread."""
        if keep is None:
            if len(self.streamed_rows) == len(self.appends):
                return list(zip(self.streamed_ids, tokens))
            return [(rid, tokens[i]) for rid, i in zip(self.streamed_ids, self.streamed_rows)]
        return [(rid, tokens[i]) for rid, i in zip(self.streamed_ids, self.streamed_rows) if keep[i]]


@dataclass(frozen=True, slots=True)
class RowsTaken:
    """How rows were deleted: row j of the batch after is row order[j] of the one before; deleted: the rows deleted
    (of the rows before)."""

    order: np.ndarray
    deleted: list[int]


def mask_without(n: int, rows: list[int]) -> list[bool]:
    """[True] * n but False at rows."""
    mask = [True] * n
    for row in rows:
        mask[row] = False
    return mask


class RunningBatch:
    """Every running request: the prefilling ones as a list, the decode rows as numpy arrays updated in place."""

    # per-row int64 arrays: the rows of one matrix (_ints), so a row change rebuilds one array, not several; each
    # name is a view of its matrix row (in-place updates reach the matrix), rebound whenever the matrix is replaced
    _INTS = ("computed", "kv_slots", "token_cap", "num_blocks", "table_rows", "table_ids", "src_rows")

    def __init__(self, block_size: int, max_model_len: int, max_blocks: int) -> None:
        self.serial = next(_SERIALS)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks
        self.requests: list[Request] = []  # the decode rows' requests, in row order
        self.request_ids: list[str] = []
        # each row's output_token_ids.append, replaced (never changed in place) when rows leave or join, so a packed
        # step's rows keep theirs
        self.appends: list = []
        self.streamed: list[bool] = []  # per row, whether its caller streams: an event every step
        self.last_step_id = -1  # the rows' newest step
        self.advances = 0  # steps advanced so far: a row counts num_computed_tokens = advances + its own offset
        # (capacity, max_blocks) the rows' KV blocks: row i's in store row table_rows[i], so a row that leaves or
        # joins moves one index, not the tables of the rows after it; a row's entries past its num_blocks are stale
        # (valid block ids, never read)
        self.table_store = np.zeros((16, max_blocks), dtype=np.int32)
        self._free_store_rows = list(range(len(self.table_store) - 1, -1, -1))  # a stack, the lowest row on top
        # each row's store row gets a number never given before in this batch (table_ids), so a slot can tell the
        # block-table rows it holds from a store row reused by a later row
        self._table_ids = count()
        self._arange = np.arange(16)
        self._set_arrays(np.zeros((len(self._INTS), 0), dtype=np.int64))
        # the rows' tokens that end a request, each with the number of rows it ends: a step that samples one is
        # checked row by row; and how many rows are not plain greedy, edit logits, follow a grammar, or may draft
        self._stop_counts: Counter = Counter()
        self.stop_ids: frozenset = frozenset()
        self._not_plain = self._editing = self._constrained = self._may_draft = 0
        # rows whose every token the update checks: they report logprobs or advance a grammar's matcher
        self._checked: set[Request] = set()
        self._index_rows()
        self.version = 0  # bumped whenever rows leave or join: a step packed under another version has other rows
        # how each recent version came from the one before: ("take", RowsTaken) or ("append", requests added at the
        # end), so per-row state kept elsewhere can follow the rows without reading every request
        self.changes: dict[int, tuple[str, object]] = {}
        # running requests that prefill (not rows yet); and, for those the step packed last sampled, their output
        # row there
        self.prefilling: list[Request] = []
        self.prefill_rows: dict[int, int] = {}
        self.packed_rows: dict[int, PackedRows] = {}  # by version: the rows of the steps packed lately

    @property
    def all_plain_greedy(self) -> bool:
        """Every row samples its argmax with nothing to edit or report (Request.plain_greedy)."""
        return not self._not_plain

    @property
    def any_edits_logits(self) -> bool:
        return bool(self._editing)

    @property
    def any_constrained(self) -> bool:
        """Some row follows a grammar (structured outputs): its step's sampling needs a token mask."""
        return bool(self._constrained)

    @property
    def draftable_rows(self) -> int:
        """Rows that may take drafts at the next step (Request.may_speculate)."""
        return self._may_draft

    def _columns(self, reqs: list[Request], src_rows) -> np.ndarray:
        """The per-row values for reqs, read from the requests themselves: (len(_INTS), rows) ints."""
        cap, bs = self.max_model_len, self.block_size
        # computed: tokens whose KV is written or queued; kv_slots: the KV cache slot of the last of them (a row's
        # blocks cover its tokens exactly, so the next position lies in its last block or in the block added for
        # it); token_cap: a row may take a step only while its token count stays below it (max_tokens,
        # max_model_len); src_rows: its row in the step packed last (carry-over reads that step's sampled token)
        rows = self._store_tables(reqs)
        return np.array([[r.num_computed_tokens for r in reqs],
                         [r.block_ids[(r.num_computed_tokens - 1) // bs] * bs + (r.num_computed_tokens - 1) % bs
                          for r in reqs],
                         [min(cap, r.num_prompt_tokens + r.params.max_tokens) for r in reqs],
                         [len(r.block_ids) for r in reqs],
                         rows,
                         [next(self._table_ids) for _ in rows],
                         list(src_rows)], dtype=np.int64).reshape(len(self._INTS), len(reqs))

    def _store_tables(self, reqs: list[Request]) -> list[int]:
        """Write reqs' blocks into free rows of the table store (it doubles when too few are free); their rows."""
        free = self._free_store_rows
        if len(reqs) > len(free):
            old = len(self.table_store)
            size = max(2 * old, old + len(reqs))
            grown = np.zeros((size, self.max_blocks), dtype=np.int32)
            grown[:old] = self.table_store
            self.table_store = grown
            free[:0] = range(size - 1, old - 1, -1)  # under the free rows already there
        rows = [free.pop() for _ in reqs]
        store = self.table_store
        for row, req in zip(rows, reqs):
            store[row, :len(req.block_ids)] = req.block_ids
        return rows

    @property
    def tables(self) -> np.ndarray:
        """(rows, max_blocks) each row's KV blocks, in row order (a copy; entries past a row's num_blocks are
        stale)."""
        return self.table_store[self.table_rows]

    def _set_arrays(self, ints: np.ndarray) -> None:
        self._ints = ints
        (self.computed, self.kv_slots, self.token_cap, self.num_blocks, self.table_rows, self.table_ids,
         self.src_rows) = ints

    def _index_rows(self) -> None:
        streamed = self.streamed
        if not any(streamed):  # callers that take only the final output (generate(), benchmarks)
            self.streamed_rows, self.streamed_ids = [], []
        elif all(streamed):
            self.streamed_rows, self.streamed_ids = list(range(len(streamed))), list(self.request_ids)
        else:
            self.streamed_rows = list(compress(range(len(streamed)), streamed))
            self.streamed_ids = list(compress(self.request_ids, streamed))
        n = len(self.requests)
        if len(self._arange) < n:
            self._arange = np.arange(2 * n)
        self.rows = self._arange[:n]  # 0, 1, ..., n - 1 (a view: never written)

    def __len__(self) -> int:
        """The decode rows (the prefilling requests are not counted)."""
        return len(self.requests)

    def admit(self, req: Request) -> None:
        """A request starts running: it prefills, then becomes a row."""
        self.prefilling.append(req)

    def remove(self, req: Request) -> None:
        """A request finished or was preempted: it leaves (nothing happens if it is neither a row nor prefilling)."""
        if req.row_batch is self:
            self._delete(np.array([self.requests.index(req)]))
        elif req in self.prefilling:
            self.prefilling.remove(req)

    def release_all(self) -> None:
        """Every row's request takes its counts back (the engine failed or stopped them all; the batch is dropped)."""
        for req in self.requests:
            req.leave_rows()

    def retire_rows_at_length_limit(self) -> None:
        """Rows whose next step would reach max_tokens or max_model_len feed nothing more: their last token is
        still on the device, and its update finishes them. They leave the rows now."""
        rows = (self.computed + 1 >= self.token_cap).nonzero()[0]
        if rows.size:
            self._delete(rows)

    def _delete(self, rows: np.ndarray) -> None:
        """Delete these rows (distinct): each one's place is taken by the last row then, so the rows kept stay where
        they were but those moved into the holes (recorded as ("take", RowsTaken))."""
        self._free_store_rows.extend(self.table_rows[rows].tolist())
        appends = self.appends.copy()  # a new list: a packed step's rows keep theirs
        lists, ints = (self.requests, self.request_ids, self.streamed, appends), self._ints
        order, m = np.arange(len(self.requests)), len(self.requests)
        for row in sorted(rows.tolist(), reverse=True):  # the last row is never one still to delete
            self._count_flags(self.requests[row], -1)
            self.requests[row].leave_rows()
            m -= 1
            for values in lists:
                last = values.pop()
                if row < m:
                    values[row] = last
            if row < m:
                ints[:, row] = ints[:, m]  # in place: a packed step keeps copies of the columns it reads later
                order[row] = order[m]
        self.appends = appends
        order = order[:m]
        self._set_arrays(ints[:, :m])
        self._index_rows()
        self._changed(("take", RowsTaken(order, rows.tolist())))

    def _count_flags(self, req: Request, sign: int) -> None:
        """A row joins (sign 1) or leaves (-1): the batch's counts of rows by kind follow."""
        self._not_plain += sign * (not req.plain_greedy)
        self._editing += sign * req.edits_logits
        self._constrained += sign * (req.grammar is not None)
        self._may_draft += sign * req.may_speculate
        if req.params.logprobs is not None or req.grammar is not None:
            if sign > 0:
                self._checked.add(req)
            else:
                self._checked.discard(req)
        if req.stop_ids:
            counts = self._stop_counts
            for tok in req.stop_ids:
                counts[tok] += sign
                if not counts[tok]:
                    del counts[tok]
            self.stop_ids = frozenset(counts)

    def packed(self, sampled: list[Request]) -> None:
        """A step was packed from these rows (then the prefilling requests' rows of `sampled`, the step's sampled
        requests): the next step carries over from it row for row."""
        self.src_rows[:] = self.rows  # in place: src_rows is a row of the matrix
        n = len(self.requests)
        self.prefill_rows = {id(r): row for row, r in enumerate(sampled[n:], start=n)} if len(sampled) > n else {}
        checked = None
        if self._checked:
            checked = np.array([row for row, req in enumerate(self.requests) if req in self._checked], dtype=np.int64)
        # the lists below are replaced, never changed in place, when rows leave or join: references suffice
        self.packed_rows[self.version] = PackedRows(self.streamed_rows, self.streamed_ids, self.appends, self.stop_ids,
                                                    self.computed.copy(), self.token_cap.copy(), checked)
        while len(self.packed_rows) > 3:  # the steps in flight need theirs; versions may jump several a step
            del self.packed_rows[next(iter(self.packed_rows))]  # the oldest (dicts keep insertion order)

    def promote_prefilled(self) -> None:
        """Prefilling requests whose prompt is done and whose first token the last step sampled become rows (at the
        end), all in one append: the arrays and the row index are rebuilt once however many join."""
        ready = [(req, self.prefill_rows.get(id(req))) for req in self.prefilling]
        ready = [(req, src) for req, src in ready
                 if src is not None and req.num_tokens - req.num_computed_tokens == 1
                 and req.num_computed_tokens >= req.num_prompt_tokens]
        if not ready:
            return
        joined = {id(req) for req, _ in ready}
        self.prefilling = [req for req in self.prefilling if id(req) not in joined]
        self._append([req for req, _ in ready], np.array([src for _, src in ready]))

    def _append(self, reqs: list[Request], src_rows: np.ndarray) -> None:
        self.requests.extend(reqs)
        self.appends = self.appends + [r.output_token_ids.append for r in reqs]
        self.request_ids.extend(r.request_id for r in reqs)
        self.streamed.extend(not r.final_only for r in reqs)
        self._set_arrays(np.concatenate([self._ints, self._columns(reqs, src_rows.tolist())], axis=1))
        # the rows' newest step: the one that sampled the joining rows' tokens is the step packed last, which holds
        # every row there was then too
        self.last_step_id = max(self.last_step_id, max(r.last_step_id for r in reqs))
        for req in reqs:
            self._count_flags(req, 1)
            req.join_rows(self)
        self._index_rows()
        self._changed(("append", list(reqs)))

    def _changed(self, change: tuple[str, object]) -> None:
        self.version += 1
        self.changes[self.version] = change
        while len(self.changes) > _KEPT_CHANGES:
            del self.changes[next(iter(self.changes))]  # the oldest

    def changes_since(self, version: int) -> list[tuple[str, object]] | None:
        """The recorded changes from `version` to now, oldest first; None when one of them is no longer recorded."""
        if self.version - version > len(self.changes):  # the recorded versions are the latest, one after another
            return None
        return [self.changes[v] for v in range(version + 1, self.version + 1)]

    def rows_gone_since(self, version: int, n: int) -> list[int] | None:
        """Of the n rows the batch had at `version`, those that are no longer rows now (ascending), from the recorded
        changes; None when a change since then is no longer recorded."""
        if version == self.version:
            return []
        changes = self.changes_since(version)
        if changes is None:
            return None
        takes = [change for kind, change in changes if kind == "take"]
        if not takes:  # appends alone keep every row where it was
            return []
        if len(takes) == 1:  # the common case: rows were deleted once (appends keep the rows before them in place)
            return sorted(row for row in takes[0].deleted if row < n)
        # per row, its row then (n and past: appended since; None while that is the row itself, as after appends
        # alone, which number the appended rows n and past)
        origin = None
        for kind, change in changes:
            if kind == "take":
                origin = change.order if origin is None else origin[change.order]
            elif origin is not None:
                origin = np.concatenate([origin, np.full(len(change), n)])
        gone = np.ones(n + 1, dtype=bool)
        gone[np.minimum(origin, n)] = False
        return gone[:n].nonzero()[0].tolist()

    def rows_needing_block(self) -> np.ndarray:
        """Rows whose next token starts a KV block they do not hold yet."""
        return (self.computed >= self.num_blocks * self.block_size).nonzero()[0]

    def add_blocks(self, rows: np.ndarray, blocks: list[int]) -> None:
        """Each of rows (distinct rows) starts its next token in a new block: the one of blocks at its place."""
        self.table_store[self.table_rows[rows], self.num_blocks[rows]] = blocks
        self.num_blocks[rows] += 1
        self.kv_slots[rows] = np.asarray(blocks) * self.block_size - 1  # the next advance moves each to its first slot

    def add_draft_blocks(self, row: int, blocks: list[int]) -> None:
        """Blocks a row's drafted tokens take this step, past the one its fed token lies in (its KV slot stays)."""
        start = int(self.num_blocks[row])
        self.table_store[self.table_rows[row], start:start + len(blocks)] = blocks
        self.num_blocks[row] += len(blocks)

    def keep_drafts(self, row: int, kept: int) -> None:
        """A row kept `kept` of its drafted tokens: its count grows by them, and its blocks and KV slot are those of
        its tokens now (the caller returns the blocks past them first)."""
        req = self.requests[row]
        req.num_computed_tokens = req.num_computed_tokens + kept  # the request's offset, then the row's array
        computed = int(self.computed[row]) + kept
        self.computed[row] = computed
        if len(req.block_ids) != self.num_blocks[row]:
            # blocks returned: a slot's copy of this row may hold one of them where a later block goes, at a count it
            # would take as current; a new table id makes every slot write the row whole
            self.table_ids[row] = next(self._table_ids)
            self.num_blocks[row] = len(req.block_ids)
        bs = self.block_size
        self.kv_slots[row] = req.block_ids[(computed - 1) // bs] * bs + (computed - 1) % bs

    def advance(self, step_id: int) -> None:
        """Count one scheduled token for every row: its arrays, its count of steps (which the rows' requests read)
        and the rows' newest step."""
        self.advances += 1
        self.last_step_id = step_id
        self._ints[:2] += 1  # computed and kv_slots: one more token each, in its row's last block
