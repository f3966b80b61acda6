"""Turn one Triton response (gRPC InferResult or HTTP JSON) into a Chunk."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from tandem_client.errors import TandemError
from tandem_client.schema import Chunk


def _text(value: Any) -> str | None:
    """A BYTES output as str: scalar, list or array of pieces (joined)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    if not isinstance(value, list):
        value = [value]
    return "".join(v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in value)


def _int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    if isinstance(value, list):
        return int(value[0]) if value else None
    return int(value)


def _ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return [int(v) for v in value.reshape(-1)]
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _logprobs(value: Any) -> Any:
    text = _text(value)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text  # keep what the server sent rather than fail the whole answer


def _chunk(get, final: bool) -> Chunk:
    finish = _text(get("finish_reason"))
    if finish == "None":  # the vLLM convention for "not finished yet"
        finish = None
    return Chunk(
        text=_text(get("text_output")) or "",
        num_output_tokens=_int(get("num_output_tokens")),
        num_input_tokens=_int(get("num_input_tokens")),
        finish_reason=finish or None,
        output_ids=_ids(get("output_ids")),
        logprobs=_logprobs(get("logprobs")),
        final=final,
    )


def chunk_from_grpc(result) -> Chunk:
    """From a tritonclient.grpc InferResult; `final` from the triton_final_response parameter."""
    params = result.get_response().parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    return _chunk(result.as_numpy, final)


def is_empty_grpc(result) -> bool:
    """The empty final response Triton adds with enable_empty_final_response: no outputs at all."""
    return len(result.get_response().outputs) == 0


def chunk_from_json(payload: str | dict) -> Chunk:
    """From one /generate body or one /generate_stream event; {"error": msg} raises TandemError."""
    data = json.loads(payload) if isinstance(payload, str) else payload
    if not isinstance(data, dict):
        raise TandemError(f"unexpected response from server: {payload!r:.200}")
    if "error" in data:
        raise TandemError(str(data["error"]))  # SSE errors mid-stream carry no status code
    chunk = _chunk(data.get, final=False)
    chunk.final = chunk.finish_reason is not None  # SSE has no final flag; the stream's end is the real one
    return chunk


def error_message_from_body(body: str) -> str | None:
    """Triton's error text from a plain JSON body or a one-event SSE body."""
    for candidate in (body, body.strip().removeprefix("data:").strip()):
        try:
            data = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(data, dict) and "error" in data:
            return str(data["error"])
    return body.strip() or None
