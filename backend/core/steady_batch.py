"""The steady decode batch: the same running requests step after step, kept in arrays updated in place.

Most steps of a long generation feed one token to every running request and change nothing else. For such a
run of steps the scheduler, the packer and the result update each work on these arrays with numpy instead of
walking the requests: the per-request Python that is left is one short loop when a step's tokens arrive (each
row's token appended to its request). The rows' token counts live in the batch while they are rows: a row's
request is brought up to date (`sync`) where something reads its counts, and when it leaves.

A request that finishes (length, stop token, abort) leaves the run as a deleted row, whose place the last row takes
(so one row moves, and a slot rewrites one block-table row, not those of every row after it); the other rows keep
going, and the next step's carry-over reads each row's token from its old row of the step before. A request admitted
during the run is a joiner: its prefill chunks follow the rows in the same steps, by the general rules, and once
it has sampled its first token it becomes a row at the end. The update of a step whose rows changed after it was
packed, or that samples a stop token or nears a length limit, is the general one. A preemption ends the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import compress, count

import numpy as np

from backend.request import Request

_KEPT_CHANGES = 8  # row changes remembered (SteadyBatch.changes): a step's rows change a few times at most
_SERIALS = count()  # each steady batch's number, so state kept about one (a slot's block tables) names it


@dataclass(slots=True)
class PackedRows:
    """The steady rows as one step was packed from them: what that step's update needs once rows left or joined."""

    streamed_rows: list[int]
    streamed_ids: list[str]
    appends: list  # each row's output_token_ids.append
    stop_ids: frozenset
    computed: np.ndarray  # (rows,) tokens counted, this step's included (a copy: the batch's columns change in place)
    token_cap: np.ndarray  # (rows,) a copy too

    def rows_that_may_end(self, tokens: list[int]) -> np.ndarray:
        """As SteadyBatch.rows_that_may_end, with one more token of margin: these counts predate the next step's."""
        risky = self.computed + 3 >= self.token_cap
        if not self.stop_ids.isdisjoint(tokens):
            risky |= np.isin(np.asarray(tokens), np.fromiter(self.stop_ids, dtype=np.int64))
        return risky.nonzero()[0]


@dataclass(frozen=True, slots=True)
class RowsTaken:
    """How rows were deleted: row j of the batch after is row order[j] of the one before; deleted: the rows deleted
    (of the rows before)."""

    order: np.ndarray
    deleted: list[int]


def accept_pending(appends: list, tokens: list[int], keep: list[bool] | None = None) -> None:
    """Request.accept_token for each row (with keep: those it marks) and its token, in one short loop: appends holds
    each row's output_token_ids.append (a request's pending count follows its token lists)."""
    pairs = zip(appends, tokens) if keep is None else compress(zip(appends, tokens), keep)
    for append, tok in pairs:
        append(tok)


def mask_without(n: int, rows: list[int]) -> list[bool]:
    """[True] * n but False at rows."""
    mask = [True] * n
    for row in rows:
        mask[row] = False
    return mask


class SteadyBatch:
    """The decoding running requests as rows: their KV positions, block tables and limits as numpy arrays."""

    # per-row int64 arrays: the rows of one matrix (_ints), so a row change rebuilds one array, not six; each name
    # is a view of its matrix row (in-place updates reach the matrix), rebound whenever the matrix is replaced
    _INTS = ("computed", "kv_slots", "token_cap", "num_blocks", "table_rows", "table_ids", "src_rows")

    def __init__(self, requests: list[Request], block_size: int, max_model_len: int, max_blocks: int) -> None:
        self.serial = next(_SERIALS)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks
        self.requests = list(requests)
        self.request_ids = [r.request_id for r in self.requests]
        # each row's output_token_ids.append, replaced (never changed in place) when rows leave or join, so a packed
        # step's rows keep theirs
        self.appends = [r.output_token_ids.append for r in self.requests]
        self.last_step_id = max((r.last_step_id for r in self.requests), default=-1)  # the rows' newest step
        # the steps advanced so far; a row's request counts num_computed_tokens = advances + its offset here (its
        # own fields fall behind while it is a row; sync writes them). Keyed by request (hashed by identity), so a
        # finished non-row is found out in O(1)
        self.advances = 0
        self._offsets = {r: r.num_computed_tokens for r in self.requests}
        # (capacity, max_blocks) the rows' KV blocks: row i's in store row table_rows[i], so a row that leaves or
        # joins moves one index, not the tables of the rows after it; a row's entries past its num_blocks are stale
        # (valid block ids, never read)
        self.table_store = np.zeros((max(2 * len(self.requests), 16), max_blocks), dtype=np.int32)
        self._free_store_rows = list(range(len(self.table_store) - 1, -1, -1))  # a stack, the lowest row on top
        # each row's store row gets a number never given before in this batch (table_ids), so a slot can tell the
        # block-table rows it holds from a store row reused by a later row
        self._table_ids = count()
        # per row, its row in the step packed last (carry-over reads that step's sampled token from there)
        self._set_arrays(self._columns(self.requests, range(len(self.requests))))
        # per row, whether its caller streams: it gets a (request_id, token) event every step
        self.streamed = [not r.final_only for r in self.requests]
        # any row's stop token: a step that samples one goes to the general update, which checks each row
        self.stop_ids = frozenset().union(*(r.stop_ids for r in self.requests))
        self.all_plain_greedy = all(r.plain_greedy for r in self.requests)
        self.any_edits_logits = any(r.edits_logits for r in self.requests)  # stays set once a row had edits
        self._arange = np.arange(2 * len(self.requests))
        self._index_rows()
        self.version = 0  # bumped whenever rows leave or join: a step packed under another version has other rows
        # how each recent version came from the one before: ("take", RowsTaken) or ("append", requests added at the
        # end), so per-row state kept elsewhere can follow the rows without reading
        # every request
        self.changes: dict[int, tuple[str, object]] = {}
        # running requests admitted during the run, not rows yet (prefilling); and, for those the step packed last
        # sampled, their output row there
        self.joiners: list[Request] = []
        self.joiner_rows: dict[int, int] = {}
        self.packed_rows: dict[int, PackedRows] = {}  # by version: the rows of the steps packed lately

    def _columns(self, reqs: list[Request], src_rows) -> np.ndarray:
        """The per-row values for reqs, read from the requests themselves: (len(_INTS), rows) ints."""
        cap, bs = self.max_model_len, self.block_size
        # computed: tokens whose KV is written or queued (== request.num_computed_tokens while this batch is
        # current); kv_slots: the KV cache slot of the last of them (a row's blocks cover its tokens exactly, so the
        # next position lies in its last block or in the block added for it); token_cap: a row may take a steady
        # step only while its token count stays below it (max_tokens, max_model_len); src_rows: its row in the step
        # packed last (carry-over reads that step's sampled token from there)
        rows = self._store_tables(reqs)
        return np.array([[r.num_computed_tokens for r in reqs],
                         [r.block_ids[(r.num_computed_tokens - 1) // bs] * bs + (r.num_computed_tokens - 1) % bs
                          for r in reqs],
                         [min(cap, r.num_prompt_tokens + r.params.max_tokens) for r in reqs],
                         [len(r.block_ids) for r in reqs],
                         rows,
                         [next(self._table_ids) for _ in rows],
                         list(src_rows)], dtype=np.int64).reshape(len(self._INTS), len(reqs))

    def _store_tables(self, reqs: list[Request]) -> np.ndarray:
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
        return len(self.requests)

    def remove(self, req: Request) -> None:
        """A request finished: delete its row (nothing happens if it is not one of the rows any more)."""
        if req in self.joiners:
            self.joiners.remove(req)
            return
        if req in self._offsets:  # most finishing requests left the rows already (retired at their length limit)
            self._delete(np.array([self.requests.index(req)]))

    def retire_rows_at_length_limit(self) -> None:
        """Rows whose next step would reach max_tokens or max_model_len feed nothing more: their last token is
        still on the device, and its update finishes them. They leave the run now."""
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
            self._hand_back((self.requests[row],))
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

    def packed(self, sampled: list[Request]) -> None:
        """A step was packed from these rows (then the joiners' rows of `sampled`, the step's sampled requests):
        the next step carries over from it row for row."""
        self.src_rows[:] = self.rows  # in place: src_rows is a row of the matrix
        n = len(self.requests)
        self.joiner_rows = {id(r): row for row, r in enumerate(sampled[n:], start=n)} if len(sampled) > n else {}
        # the lists below are replaced, never changed in place, when rows leave or join: references suffice
        self.packed_rows[self.version] = PackedRows(self.streamed_rows, self.streamed_ids, self.appends, self.stop_ids,
                                                    self.computed.copy(), self.token_cap.copy())
        while len(self.packed_rows) > 3:  # the steps in flight need theirs; versions may jump several a step
            del self.packed_rows[next(iter(self.packed_rows))]  # the oldest (dicts keep insertion order)

    def take_joiners(self) -> None:
        """Joiners whose prompt is done and whose first token the last step sampled become rows (at the end), all
        in one append: the arrays and the row index are rebuilt once however many join."""
        ready = [(req, self.joiner_rows.get(id(req))) for req in self.joiners]
        ready = [(req, src) for req, src in ready
                 if src is not None and req.num_tokens - req.num_computed_tokens == 1
                 and req.num_computed_tokens >= req.num_prompt_tokens and self.eligible(req)]
        if not ready:
            return
        joined = {id(req) for req, _ in ready}
        self.joiners = [req for req in self.joiners if id(req) not in joined]
        self._append([req for req, _ in ready], np.array([src for _, src in ready]))

    def _append(self, reqs: list[Request], src_rows: np.ndarray) -> None:
        self.requests.extend(reqs)
        self.appends = self.appends + [r.output_token_ids.append for r in reqs]
        self._offsets.update((r, r.num_computed_tokens - self.advances) for r in reqs)
        self.request_ids.extend(r.request_id for r in reqs)
        self.streamed.extend(not r.final_only for r in reqs)
        self._set_arrays(np.concatenate([self._ints, self._columns(reqs, src_rows.tolist())], axis=1))
        self.stop_ids = self.stop_ids.union(*(r.stop_ids for r in reqs))
        self.all_plain_greedy = self.all_plain_greedy and all(r.plain_greedy for r in reqs)
        self.any_edits_logits = self.any_edits_logits or any(r.edits_logits for r in reqs)
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

    @staticmethod
    def eligible(req: Request) -> bool:
        """A request a steady run can carry as a row: no logprobs (they need the general read and update)."""
        return req.params.logprobs is None

    def rows_needing_block(self) -> np.ndarray:
        """Rows whose next token starts a KV block they do not hold yet."""
        return (self.computed >= self.num_blocks * self.block_size).nonzero()[0]

    def add_block(self, row: int, block: int) -> None:
        """The row's next token starts a block: this one."""
        self.add_blocks(np.array([row]), [block])

    def add_blocks(self, rows: np.ndarray, blocks: list[int]) -> None:
        """Each of rows (distinct rows) starts its next token in a new block: the one of blocks at its place."""
        self.table_store[self.table_rows[rows], self.num_blocks[rows]] = blocks
        self.num_blocks[rows] += 1
        self.kv_slots[rows] = np.asarray(blocks) * self.block_size - 1  # the next advance moves each to its first slot

    def advance(self, step_id: int) -> None:
        """Count one scheduled token for every row, in the batch only: its arrays, its count of steps and the rows'
        newest step (last_step_id). The requests' own counters follow when synced (sync, and when they leave)."""
        self.advances += 1
        self.last_step_id = step_id
        self._ints[:2] += 1  # computed and kv_slots: one more token each, in its row's last block

    def sync(self, req: Request) -> None:
        """Bring req's token counts and newest step up to date if it is a row (nothing happens otherwise). A row
        holds exactly one token not fed yet (the one it sampled last), as when it joined."""
        offset = self._offsets.get(req)
        if offset is not None:
            req.num_computed_tokens = computed = self.advances + offset
            req.num_tokens = computed + 1
            req.last_step_id = self.last_step_id

    def sync_rows(self) -> None:
        """sync for every row (before code that reads every row's counts: logit edits, penalties)."""
        for req in self.requests:
            self.sync(req)

    def rows_that_may_end(self, tokens: list[int]) -> np.ndarray:
        """Rows this step's tokens may end, which the general update must look at: near a length limit, or a
        token that is one of any row's stop tokens."""
        risky = self.computed + 2 >= self.token_cap  # (rows,)
        if not self.stop_ids.isdisjoint(tokens):
            risky |= np.isin(np.asarray(tokens), np.fromiter(self.stop_ids, dtype=np.int64))
        return risky.nonzero()[0]

    def accept(self, tokens: list[int], keep: list[bool] | None = None) -> None:
        """Every row's pending token (with keep: the rows it marks) arrived and ends no request."""
        accept_pending(self.appends, tokens, keep)

    def release_rows(self) -> None:
        """The batch is no longer the scheduler's: its rows' requests take their counts and newest step back."""
        self._hand_back(list(self.requests))

    def _hand_back(self, reqs) -> None:
        """Requests leaving the rows: their own counts are current again (the batch kept them meanwhile)."""
        for req in reqs:
            self.sync(req)
            del self._offsets[req]

    def events(self, tokens: list[int], keep: list[bool] | None = None) -> list[tuple[str, int]]:
        """(request_id, token) for each streamed row (with keep: of the rows it marks), made into outputs by the
        output thread."""
        if keep is None:
            if len(self.streamed_rows) == len(self.requests):
                return list(zip(self.request_ids, tokens))
            return [(rid, tokens[i]) for rid, i in zip(self.streamed_ids, self.streamed_rows)]
        return [(rid, tokens[i]) for rid, i in zip(self.streamed_ids, self.streamed_rows) if keep[i]]
