"""Rank 0 of a tensor-parallel engine: its own shard of the model, and the worker processes that hold the others.

The engine's runner calls this object as it calls a whole model. Each forward step is broadcast to the workers
(what to run and its inputs), then run on this rank's shard while the workers run theirs: the sums over the ranks
inside the layers keep every rank's hidden states equal. The LM head's vocabulary columns are gathered here, so
the sampler sees whole logits. The scheduler, the KV block bookkeeping and sampling run once, on rank 0.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

import torch

from backend.models.loader import load_model, read_spec
from backend.parallel import steps
from backend.parallel.group import TensorParallelGroup
from backend.parallel.sharding import Shard
from backend.parallel.worker import run_worker

log = logging.getLogger("tandem.parallel")

START_TIMEOUT_S = 600.0  # a worker that has not loaded its shard by then fails the engine's start
STOP_TIMEOUT_S = 10.0  # a worker still alive this long after the stop message is terminated


class TensorParallelModel:
    """The model on rank 0: steps broadcast to the worker ranks, run on its own shard, logits gathered here."""

    def __init__(self, local, group: TensorParallelGroup, workers: list, store_dir: str) -> None:
        self.local = local
        self.group = group
        self.workers = workers
        self._store_dir = store_dir
        self.spec = local.spec  # this rank's heads and MLP columns (so the KV cache is sized per rank), whole vocab
        self.ops = local.ops
        self._closed = False

    @classmethod
    def start(cls, world: int, load: dict) -> "TensorParallelModel":
        """Start world - 1 worker processes, load this rank's shard, and join them; load holds load_model's
        arguments. Raises ValueError when the model does not split over world ranks, before any worker starts."""
        Shard(0, world).check(read_spec(load["path"], load.get("dtype", torch.float32)))
        store_dir = tempfile.mkdtemp(prefix="tandem-tp-")
        store_file = os.path.join(store_dir, "store")
        ctx = multiprocessing.get_context("spawn")
        ctx.set_executable(_python())
        workers, conns = [], []
        try:
            for rank in range(1, world):
                receive, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=run_worker, args=(rank, world, store_file, load, send), daemon=True,
                                   name=f"tandem-tp-rank{rank}")
                with _main_module_hidden():
                    proc.start()
                send.close()  # why: the child holds its own end; ours closed, a dead child reads as end of file
                workers.append(proc)
                conns.append(receive)
            local = load_model(**load, shard=Shard(0, world))
            _wait_ready(workers, conns)
            group = TensorParallelGroup.join(store_file, 0, world)
        except BaseException:
            _stop(workers)
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        local.tp = group
        log.info("tensor parallel: %d ranks (this process and %s)", world, ", ".join(str(p.pid) for p in workers))
        return cls(local, group, workers, store_dir)

    def start_cache(self, num_blocks: int, block_size: int) -> None:
        """Every worker allocates its KV cache: the same blocks as rank 0's, its own heads."""
        self.group.broadcast(steps.header(steps.OP_CACHE, num_blocks, block_size))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta
                 ) -> torch.Tensor:
        """The layers over one step: (T,) ids and positions -> (T, H) hidden states, on every rank."""
        h, payload = steps.pack_forward(input_ids, positions, meta)
        self.group.broadcast(h)
        self.group.broadcast(payload)
        return self.local(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (N, H) -> logits (N, V): each rank's vocabulary columns, gathered here."""
        hidden = hidden.contiguous()
        self.group.broadcast(steps.header(steps.OP_LOGITS, hidden.shape[0]))
        self.group.broadcast(hidden)
        logits = self.group.gather_columns(self.local.compute_logits(hidden))[:, :self.spec.vocab_size]
        return logits if out is None else out.copy_(logits)

    def lost_ranks(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of each worker that is no longer running."""
        return [(rank, proc.exitcode) for rank, proc in enumerate(self.workers, start=1) if not proc.is_alive()]

    def parameters(self):
        """This rank's weights."""
        return self.local.parameters()

    def close(self) -> None:
        """Stop the workers (told to, then terminated if they linger) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if all(proc.is_alive() for proc in self.workers):  # else a broadcast would wait for the lost rank
            try:
                self.group.broadcast(steps.header(steps.OP_STOP))
            except Exception:  # a worker lost meanwhile: the ones left are stopped below
                log.exception("tensor parallel: the stop message did not reach every worker")
        _stop(self.workers, STOP_TIMEOUT_S)
        self.group.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)


def _wait_ready(workers: list, conns: list) -> None:
    """Each worker says it loaded its shard; one that reports an error or exits first fails the start."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for rank, (proc, conn) in enumerate(zip(workers, conns), start=1):
        left = deadline - time.monotonic()
        if left <= 0 or not conn.poll(left):
            raise RuntimeError(f"tensor-parallel rank {rank} did not load its shard within {START_TIMEOUT_S:.0f} s")
        try:
            status, message = conn.recv()
        except EOFError:
            proc.join(1.0)
            raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before it was ready") \
                from None
        if status != "ready":
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {message}")


def _stop(workers: list, grace_s: float = 0.0) -> None:
    """Join the workers, terminating those still alive after grace_s."""
    for proc in workers:
        proc.join(grace_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)


@contextlib.contextmanager
def _main_module_hidden():
    """While a worker starts, this process's __main__ names no file or module, so the spawned child does not run
    the caller's script again (multiprocessing's spawn re-imports __main__ in every child otherwise: an unguarded
    script would start engines there, and a script read from stdin cannot be re-imported at all). The worker's
    entry point lives in an importable module and needs nothing from __main__."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _python() -> str:
    """The interpreter for the workers: TANDEM_PYTHON when set, else the one this process reports unless that is not
    a Python executable, else the python3 on PATH. The workers get this process's module path, so they import the
    same packages whichever interpreter of the same version runs them."""
    if os.environ.get("TANDEM_PYTHON"):
        return os.environ["TANDEM_PYTHON"]
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return shutil.which("python3") or sys.executable
