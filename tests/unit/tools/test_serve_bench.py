"""serve_bench's server-side figures: read from a metrics endpoint in Triton's Prometheus text format."""
from __future__ import annotations

import http.server
import threading

from bench.serve_bench import scrape, server_side

LABELS = '{instance="llm_0_0",model="llm",version="1"}'


def _page(itl_sum: float, itl_count: int, busy: float) -> bytes:
    return f"""# HELP tandem_inter_token_latency_seconds_sum Time between output tokens
# TYPE tandem_inter_token_latency_seconds_sum counter
tandem_inter_token_latency_seconds_sum{LABELS} {itl_sum}
tandem_inter_token_latency_seconds_count{LABELS} {itl_count}
tandem_inter_token_latency_seconds_bucket{{instance="llm_0_0",le="0.005",model="llm",version="1"}} 90
tandem_gpu_busy_ratio{LABELS} {busy}
nv_inference_count{{model="llm",version="1"}} 7
""".encode()


def _serve(pages: list[bytes]) -> tuple[http.server.HTTPServer, int]:
    """A metrics endpoint answering each GET with the next page."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = pages.pop(0)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def test_mean_inter_token_gap_and_busy_over_one_wave():
    server, port = _serve([_page(0.5, 100, 0.5), _page(2.5, 1100, 0.97)])
    try:
        before, after = scrape(port), scrape(port)
    finally:
        server.shutdown()
    assert before["tandem_inter_token_latency_seconds_count"] == 100.0
    assert "nv_inference_count" not in before  # only the engine's own samples
    # 1,000 gaps summing to 2.0 s during the wave
    assert server_side(before, after) == {"server_itl_mean_ms": 2.0, "server_gpu_busy": 0.97}
    assert server_side(after, after)["server_itl_mean_ms"] is None  # no token sent: no gap to report
