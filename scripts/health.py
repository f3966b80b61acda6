"""A liveness probe that asks the model itself: exit 0 when a 1-token request is answered, 1 otherwise.

Triton's own /v2/health/ready stays 200 while a Python-backend stub is dead (every request then fails with "Stub
process ... is not healthy"), so a Kubernetes exec probe should run this instead:

    python -m scripts.health --url localhost:8000 --model llm --timeout 10
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def probe(url: str, model: str, timeout: float) -> str | None:
    """None when the model answered a 1-token greedy request over HTTP; otherwise what went wrong."""
    base = url if url.startswith(("http://", "https://")) else f"http://{url}"
    body = json.dumps({"text_input": "ping", "exclude_input_in_output": True,
                       "sampling_parameters": json.dumps({"max_tokens": 1, "temperature": 0})}).encode()
    request = urllib.request.Request(f"{base}/v2/models/{model}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}: {err.read().decode(errors='replace')[:300]}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        return f"no answer from {base} within {timeout:g} s: {err}"
    if "text_output" not in answer:
        return f"the answer has no text_output: {str(answer)[:300]}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8000", help="Triton's HTTP address (default localhost:8000)")
    parser.add_argument("--model", default="llm", help="model name (default llm)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer (default 10)")
    args = parser.parse_args(argv)
    problem = probe(args.url, args.model, args.timeout)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
