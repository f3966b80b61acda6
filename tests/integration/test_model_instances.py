"""Two model instances (KIND_CPU, count 2): an engine each, one metrics series each, and a clean stop.

With the same metric labels in both, the instances shared each Metric object, and unloading hung in the first
instance's finalize until Triton's exit timeout killed the server.
"""
from __future__ import annotations

import time

from loadtest.server_metrics import ServerMetrics
from scripts.tritonserver_env import (free_ports, make_model_repository, start_server, stop_server, stub_pids,
                                      wait_until_ready)
from tests.integration.test_triton_serving import wait_for
from tests.served import finished_per_instance, greedy_texts

SINGLE = "instance_group [ { kind: KIND_MODEL, count: 1 } ]"
TWO_CPU = "instance_group [ { kind: KIND_CPU, count: 2 } ]"


def test_two_instances_serve_report_separately_and_stop_cleanly(tmp_path):
    repo = make_model_repository(tmp_path, {"device": "cpu", "num_kv_blocks": "128", "max_num_seqs": "8",
                                            "max_model_len": "512", "stats_interval_s": "0.2"})
    config = repo / "llm" / "config.pbtxt"
    assert SINGLE in config.read_text()
    config.write_text(config.read_text().replace(SINGLE, TWO_CPU))
    http, grpc, metrics = free_ports(3)
    proc = start_server(repo, http, grpc, metrics, ["--exit-timeout-secs=30", "--disable-auto-complete-config"],
                        log_path=tmp_path / "tritonserver.log")
    try:
        wait_until_ready(proc, http, timeout=240, model_name="llm")
        assert len(stub_pids(str(repo))) == 2
        answers = greedy_texts(http, "The capital of France is", max_tokens=6, count=6, workers=6)
        assert len(set(answers)) == 1 and answers[0]  # greedy: the same text from either engine

        samples = ServerMetrics(f"http://localhost:{metrics}/metrics").scrape()
        healthy = {labels.get("instance"): value for name, labels, value in samples if name == "tandem_engine_healthy"}
        assert healthy == {"llm_0_0": 1.0, "llm_0_1": 1.0}
        assert sum(finished_per_instance(metrics, expected_total=6).values()) == 6
    finally:
        started = time.monotonic()
        code = stop_server(proc, timeout=90)
    assert code == 0 and time.monotonic() - started < 30, "unloading two instances hung"
    # the stubs exit as the server does; under load the last one may still be tearing down when the server's own
    # process has gone
    wait_for(lambda: not stub_pids(str(repo)), 10, "both stubs to exit after the server stopped")
