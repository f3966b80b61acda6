"""Build the vLLM-backend request tensors from a GenerateRequest, for gRPC and for HTTP /generate."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from tandem_client.schema import GenerateRequest


def sampling_parameters(req: GenerateRequest) -> dict[str, Any]:
    """The `sampling_parameters` JSON object, vLLM names, only the fields the caller set."""
    params: dict[str, Any] = {
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
    }
    params = {k: v for k, v in params.items() if v is not None}
    if req.stop:
        params["stop"] = list(req.stop)
    if req.ignore_eos:
        params["ignore_eos"] = True
    params.update(req.extra)
    return params


def tensors(req: GenerateRequest) -> dict[str, tuple[np.ndarray, str]]:
    """Input name → (array, Triton datatype); shapes follow the convention (scalars as [1])."""
    out: dict[str, tuple[np.ndarray, str]] = {}
    if req.input_ids is None or req.prompt:  # token-id prompts send no text_input: the server takes one of them
        out["text_input"] = (np.array([req.prompt.encode("utf-8")], dtype=np.object_), "BYTES")
    out |= {
        "stream": (np.array([req.stream], dtype=bool), "BOOL"),
        "sampling_parameters": (np.array([json.dumps(sampling_parameters(req)).encode()], dtype=np.object_), "BYTES"),
        "exclude_input_in_output": (np.array([req.exclude_input], dtype=bool), "BOOL"),
    }
    if req.input_ids is not None:
        out["input_ids"] = (np.asarray(req.input_ids, dtype=np.int64).reshape(-1), "INT64")
    flags = ["return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"] if req.return_stats else []
    if req.return_logprobs:
        flags.append("return_logprobs")
    for name in flags:
        out[name] = (np.array([True], dtype=bool), "BOOL")
    return out


def grpc_inputs(req: GenerateRequest) -> list:
    """tritonclient.grpc InferInput objects (the aio client takes the same class)."""
    import tritonclient.grpc as grpcclient  # local: keeps the pure parts importable without grpc

    inputs = []
    for name, (array, dtype) in tensors(req).items():
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def http_body(req: GenerateRequest) -> dict[str, Any]:
    """JSON body for /generate and /generate_stream: one top-level field per input tensor."""
    body: dict[str, Any] = {}
    for name, (array, dtype) in tensors(req).items():
        if dtype == "BYTES":
            body[name] = array[0].decode("utf-8")
        elif name == "input_ids":
            body[name] = array.tolist()
        else:
            body[name] = bool(array[0])
    return body
