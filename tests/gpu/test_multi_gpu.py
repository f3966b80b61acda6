"""Several GPUs: instance_group KIND_GPU over two GPUs gives one engine per GPU, each on its own device."""
from __future__ import annotations

import re
import time

import pytest
import torch

from scripts.tritonserver_env import (free_ports, make_model_repository, start_server, stop_server, stub_pids,
                                      wait_until_ready)
from tests.served import finished_per_instance, greedy_texts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

SINGLE = "instance_group [ { kind: KIND_MODEL, count: 1 } ]"
PER_GPU = "instance_group [ { kind: KIND_GPU, count: 1, gpus: [ 0, 1 ] } ]"


def test_engine_on_second_gpu_equals_first(tmp_path):
    """An engine on cuda:1 (built and looping on threads whose current device is 0) gives cuda:0's tokens."""
    from backend import Engine, EngineConfig, SamplingParams
    from tests.tiny_models import build_tiny, random_prompts

    path = build_tiny("llama", str(tmp_path))
    prompts = random_prompts([3, 30, 9, 57], seed=4)
    got = {}
    for device in ("cuda:0", "cuda:1"):
        engine = Engine(EngineConfig(model=path, device=device, num_kv_blocks=128, max_num_seqs=8,
                                     max_num_batched_tokens=256))
        try:
            outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
            got[device] = [o.token_ids for o in outs]
            assert engine.runner.kv_cache.device == torch.device(device)
        finally:
            engine.shutdown()
    assert got["cuda:1"] == got["cuda:0"]


def test_one_engine_per_gpu(tmp_path):
    from tests.tiny_models import build_tiny

    model = build_tiny("llama", str(tmp_path))  # any checkpoint will do; this one needs no package or download
    repo = make_model_repository(tmp_path, {"model": model, "max_num_seqs": "32", "max_model_len": "1024",
                                            "kv_cache_memory_fraction": "0.05", "stats_interval_s": "0.2"})
    config = repo / "llm" / "config.pbtxt"
    config.write_text(config.read_text().replace(SINGLE, PER_GPU))
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    http, grpc, metrics = free_ports(3)
    log = tmp_path / "tritonserver.log"
    proc = start_server(repo, http, grpc, metrics, ["--exit-timeout-secs=30"], log_path=log)
    try:
        try:
            wait_until_ready(proc, http, timeout=420, model_name="llm")
        except RuntimeError as err:
            errors = [line[:1500] for line in log.read_text().splitlines()
                      if re.match(r"E\d{4}", line) or "UNAVAILABLE" in line or "rror" in line]
            raise RuntimeError(f"{err}; server log errors:\n" + "\n".join(errors[-20:])) from None
        assert len(stub_pids(str(repo))) == 2
        ready = re.findall(r"engine ready \(llm, instance (\S+), device (\S+)\)", log.read_text())
        assert sorted(device for _, device in ready) == ["cuda:0", "cuda:1"], ready
        labels = {name for name, _ in ready}
        assert len(labels) == 2, f"both instances report under one name: {ready}"
        used = [(before - torch.cuda.mem_get_info(i)[0]) / 2**30 for i, before in enumerate(free_before)]
        assert min(used) > 4, f"GiB taken on each GPU by its engine: {used}"

        answers = greedy_texts(http, "The capital of France is", max_tokens=32, count=64, workers=32)
        assert len(set(answers)) == 1 and answers[0]  # greedy: the same text whichever GPU answered
        served = finished_per_instance(metrics, expected_total=64)
        print(f"requests per instance: {served}; devices: {ready}; GiB used per GPU: {used}")
        assert sum(served.values()) == 64 and set(served) == labels
    finally:
        started = time.monotonic()
        code = stop_server(proc, timeout=90)
    assert code == 0 and time.monotonic() - started < 30, "unloading the two instances hung"
    assert not stub_pids(str(repo))
