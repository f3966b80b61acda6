"""Tensor parallelism on the CPU: two gloo ranks (this process and a worker process) run a tiny model's heads, MLP
columns and vocabulary split in two, and give the unsharded engine's greedy tokens exactly.

- the shard slices: every weight's rank slices put back together are the weight (the vocabulary padded);
- greedy tokens at two ranks equal one rank's and transformers', for Llama, Qwen2 (q/k/v biases, an o bias kept
  once), Qwen3 (per-head q/k norms) and a vocabulary two ranks split unevenly;
- a model whose heads do not split fails before any worker starts, a worker that cannot load its shard fails the
  start with its reason, and shutdown leaves no worker process behind.
"""
from __future__ import annotations

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.models.loader import read_spec
from backend.parallel.sharding import Shard
from tests.tiny_models import build_tiny, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-tp"))


def generate(path: str, prompts, tensor_parallel_size: int, max_tokens: int = 24, async_pipeline: bool = False
             ) -> tuple[list[list[int]], list]:
    """Greedy tokens of an engine on the CPU, and its worker processes (stopped by the time this returns)."""
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                                 max_num_batched_tokens=64, tensor_parallel_size=tensor_parallel_size,
                                 async_pipeline=async_pipeline))
    workers = list(getattr(engine.parts.model, "workers", []))
    kv_heads = read_spec(path).num_kv_heads
    assert engine.runner.kv_cache.shape[-2] == kv_heads // tensor_parallel_size  # this rank's heads' KV alone
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in engine.generate(prompts, params)], workers
    finally:
        engine.shutdown()


def test_shard_slices_put_back_together_are_the_weights():
    spec = read_spec(build_tiny("qwen2", "/tmp/tandem-tp-shapes"))  # Hq 4, Hkv 2, D 16, I 128, V 256
    d = spec.head_dim
    qkv = torch.arange((spec.num_heads + 2 * spec.num_kv_heads) * d * 3, dtype=torch.float32).view(-1, 3)
    gate_up = torch.arange(2 * spec.intermediate_size * 3, dtype=torch.float32).view(-1, 3)
    down = torch.arange(spec.hidden_size * spec.intermediate_size, dtype=torch.float32).view(spec.hidden_size, -1)
    embed = torch.arange(251 * 2, dtype=torch.float32).view(251, 2)
    shards = [Shard(r, 2) for r in range(2)]
    q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
    parts = [s.qkv(qkv, spec) for s in shards]
    half_q, half_kv = q_rows // 2, kv_rows // 2
    assert torch.equal(torch.cat([p[:half_q] for p in parts]), qkv[:q_rows])  # q heads split in two
    assert torch.equal(torch.cat([p[half_q:half_q + half_kv] for p in parts]), qkv[q_rows:q_rows + kv_rows])
    assert torch.equal(torch.cat([p[half_q + half_kv:] for p in parts]), qkv[q_rows + kv_rows:])
    parts = [s.gate_up(gate_up) for s in shards]
    i = spec.intermediate_size
    assert torch.equal(torch.cat([p[:i // 2] for p in parts]), gate_up[:i])
    assert torch.equal(torch.cat([p[i // 2:] for p in parts]), gate_up[i:])
    assert torch.equal(torch.cat([s.columns(down) for s in shards], dim=1), down)
    vocab = [s.vocab(embed) for s in shards]
    assert [v.shape[0] for v in vocab] == [126, 126] and [s.vocab_rows(251) for s in shards] == [(0, 126), (126, 126)]
    assert torch.equal(torch.cat(vocab)[:251], embed) and not vocab[1][-1].any()  # the pad row is zeros
    assert [s.first_only(embed) is embed for s in shards] == [True, False]
    assert Shard(1, 2).spec(spec).num_heads == 2 and Shard(1, 2).spec(spec).vocab_size == 256


@pytest.mark.parametrize("family,async_pipeline", [("llama", False), ("qwen2", False), ("qwen3", False),
                                                   ("llama-251", False), ("llama", True)])
def test_two_ranks_give_the_unsharded_greedy_tokens(root, family, async_pipeline):
    """64-token steps: prompts in chunks beside decoding rows, then decode steps; async: steps packed one ahead."""
    path = build_tiny(family, root, seed=3)
    prompts = random_prompts([5, 19, 1, 33, 70], seed=6)
    if family == "llama-251":
        prompts = [[t % 250 for t in p] for p in prompts]
    one, _ = generate(path, prompts, 1)
    two, workers = generate(path, prompts, 2, async_pipeline=async_pipeline)
    assert two == one
    assert one == [hf_greedy(path, p, 24) for p in prompts]
    assert len(workers) == 1 and not workers[0].is_alive()  # shutdown stopped the worker rank


def test_heads_that_do_not_split_fail_before_any_worker_starts(root):
    path = build_tiny("llama", root)  # 4 attention heads, 2 key/value heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the model's attention heads \(4\)"):
        Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=64, tensor_parallel_size=3))


def test_tensor_parallel_refuses_what_it_cannot_shard(root):
    with pytest.raises(ValueError, match="needs a checkpoint folder"):
        Engine(EngineConfig(model="stand-in", device="cpu", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0).validate()


def test_a_worker_that_cannot_load_its_shard_fails_the_start(root, monkeypatch):
    """Rank 0 loads its shard from the real folder while the worker is sent a folder that does not exist: the
    start fails with the worker's own reason, and no worker is left running."""
    from backend.parallel import model as tp_model

    path = build_tiny("llama", root)
    real_load = tp_model.load_model
    monkeypatch.setattr(tp_model, "read_spec", lambda p, dtype=None: read_spec(path))
    monkeypatch.setattr(tp_model, "load_model", lambda **kw: real_load(**{**kw, "path": path}))
    started = []
    real_stop = tp_model._stop
    monkeypatch.setattr(tp_model, "_stop", lambda workers, grace_s=0.0: started.extend(workers) or real_stop(
        workers, grace_s))
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 failed to start: ValueError: .* config.json is "
                                           "missing"):
        tp_model.TensorParallelModel.start(2, dict(path=path + "-missing", dtype=torch.float32, device="cpu"))
    assert len(started) == 1 and not started[0].is_alive()


def test_a_lost_worker_fails_the_requests_and_stops_the_engine(root):
    """A worker rank killed while the engine runs: the next step's requests each get one error response naming the
    rank, the engine reports itself unhealthy (no later step could run), and shutdown is prompt."""
    import os
    import signal
    import time

    path = build_tiny("llama", root)
    engine = Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=64, tensor_parallel_size=2))
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(engine.generate(random_prompts([5]), params)[0].token_ids) == 4
        worker = engine.parts.model.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        outs = engine.generate(random_prompts([5, 6]), params)
        assert [o.finish_reason for o in outs] == ["error", "error"]
        assert all("tensor-parallel rank 1 (exit code -9) exited" in o.error for o in outs), outs[0].error
        deadline = time.monotonic() + 5
        while engine.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.healthy
    finally:
        started = time.monotonic()
        engine.shutdown()
    assert time.monotonic() - started < 5
