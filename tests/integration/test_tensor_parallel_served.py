"""Tensor parallelism through a real tritonserver (CPU): one model instance whose engine runs a tiny Llama on two
ranks (its heads, MLP columns and vocabulary split in two) answers as the unsharded engine does, and leaves no worker
process behind when the server stops."""
from __future__ import annotations

from pathlib import Path

from backend import Engine, EngineConfig, SamplingParams
from scripts.tritonserver_env import (free_ports, make_model_repository, start_server, stop_server, stub_pids,
                                      wait_until_ready)
from tests.served import greedy_texts
from tests.tiny_models import build_tiny

PROMPT = "<5> <17> <40> <3> <99> <12>"  # the tiny models' word tokenizer: token i is "<i>"


def _children(pid: int) -> list[int]:
    """Processes whose parent is pid."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "Z" not in (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3])


def test_two_ranks_serve_the_unsharded_answer_and_stop_with_the_server(tmp_path):
    path = build_tiny("llama", str(tmp_path), seed=5)
    engine = Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=64, max_num_seqs=4, max_model_len=256))
    try:
        want = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].text
    finally:
        engine.shutdown()
    repo = make_model_repository(tmp_path, {"model": path, "device": "cpu", "tensor_parallel_size": "2",
                                            "num_kv_blocks": "64", "max_num_seqs": "4", "max_model_len": "256",
                                            "stats_interval_s": "0.2"})
    http, grpc, metrics = free_ports(3)
    proc = start_server(repo, http, grpc, metrics, ["--exit-timeout-secs=30", "--disable-auto-complete-config"],
                        log_path=tmp_path / "tritonserver.log")
    workers: list[int] = []
    try:
        wait_until_ready(proc, http, timeout=300, model_name="llm")
        stubs = stub_pids(str(repo))
        assert len(stubs) == 1
        workers = [pid for pid in _children(stubs[0]) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) == 1, workers  # rank 1 beside the stub's rank 0
        # the generate endpoint returns the prompt before the output (exclude_input_in_output unset)
        assert greedy_texts(http, PROMPT, max_tokens=8, count=3, workers=3) == [PROMPT + want] * 3
    finally:
        code = stop_server(proc, timeout=90)
    assert code == 0
    assert not stub_pids(str(repo))
    assert not [pid for pid in workers if _alive(pid)]
