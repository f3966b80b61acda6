"""A worker rank of a tensor-parallel engine: its shard of the model and of the KV cache, stepping with rank 0.

Started by rank 0 (backend/parallel/model.py) in a process of its own. It loads its shard first and says so (or
why it could not) through a pipe, joins the process group, then runs whatever rank 0 broadcasts until told to stop.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("tandem.parallel")


def run_worker(rank: int, world: int, store_file: str, load: dict, conn) -> None:
    """The worker process's entry point; load holds load_model's arguments (the shard is added here)."""
    from backend.models.loader import load_model
    from backend.parallel.group import TensorParallelGroup
    from backend.parallel.sharding import Shard

    torch.set_num_threads(max(1, torch.get_num_threads() // world))  # why: the ranks share the host's cores
    try:
        model = load_model(**load, shard=Shard(rank, world))
    except BaseException as exc:  # reported to rank 0, which fails the engine's start with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    conn.send(("ready", None))
    conn.close()
    group = TensorParallelGroup.join(store_file, rank, world)
    model.tp = group
    try:
        with torch.inference_mode():
            _serve(model, group)
    finally:
        group.close()


def _serve(model, group) -> None:
    from backend.parallel import steps

    spec, device = model.spec, model.embed_tokens.device
    kv_cache = None
    while True:
        h = group.broadcast(steps.header(steps.OP_STOP))
        op = int(h[0])
        if op == steps.OP_STOP:
            return
        if op == steps.OP_CACHE:
            num_blocks, block_size = int(h[1]), int(h[2])
            kv_cache = torch.zeros(spec.kv_cache_shape(num_blocks, block_size), dtype=spec.dtype, device=device)
        elif op == steps.OP_FORWARD:
            payload = group.broadcast(torch.empty(steps.forward_payload_len(h), dtype=torch.int64))
            ids, positions, meta = steps.unpack_forward(h, payload)
            model(ids.to(device), positions.to(device), kv_cache, meta)
        elif op == steps.OP_LOGITS:
            rows = group.broadcast(torch.empty(int(h[1]), spec.hidden_size, dtype=spec.dtype, device=device))
            group.gather_columns(model.compute_logits(rows))
        else:
            raise RuntimeError(f"unknown step op {op} from rank 0")
