"""Triton request tensors → a validated ParsedRequest; engine updates → response tensors (vLLM-backend names)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from backend.request import SamplingParams
from backend.text_values import parse_bool
from vllm_compat import translate_vllm_keys

RETURN_FLAGS = (
    "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
    "return_output_ids", "return_cumulative_logprob",
)
_INT_FIELDS = {"max_tokens", "min_tokens", "top_k", "seed", "logprobs", "n", "truncate_prompt_tokens"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculate"}

GetInput = Callable[[str], "np.ndarray | None"]


@dataclass(slots=True)
class ParsedRequest:
    """One parsed generate request: the prompt, how to sample, and what to send back."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    prepend_input: bool  # non-streaming only: the prompt text comes first in text_output
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_output_ids: bool = False
    return_cumulative_logprob: bool = False
    asked_logprobs: bool = False  # the sampling parameters asked for logprobs (else the logprobs output is null)


def parse_request(get_input: GetInput, request_parameters: str | None) -> ParsedRequest:
    """Raise ValueError naming the field at fault; `get_input(name)` returns the tensor as numpy or None."""
    try:
        return _parse(get_input, request_parameters)
    except (TypeError, OverflowError, RecursionError) as err:  # a value of the wrong kind or size, deep inside
        raise ValueError(f"malformed request: {err}") from None


def _parse(get_input: GetInput, request_parameters: str | None) -> ParsedRequest:
    prompt = _prompt(get_input)
    stream = _flag(get_input, "stream", False)
    exclude = _flag(get_input, "exclude_input_in_output", None)
    # vLLM backend: non-streaming output includes the prompt unless excluded; streams never do.
    if stream and exclude is False:
        raise ValueError("exclude_input_in_output: false is not allowed when streaming (stream: true)")
    prepend = (not stream) and exclude is not True
    params = sampling_params(_json_object(request_parameters, "parameters"), _sampling_tensor(get_input))
    flags = {name: bool(_flag(get_input, name, False)) for name in RETURN_FLAGS}
    if isinstance(prompt, list):
        flags["return_output_ids"] = True  # clients that bring token ids want token ids back
    asked = params.logprobs is not None
    if flags["return_cumulative_logprob"] and not asked:
        params.logprobs = 0  # the sampled tokens' logprobs, for their sum
    return ParsedRequest(prompt, params, bool(stream), prepend, asked_logprobs=asked, **flags)


def _prompt(get_input: GetInput) -> str | list[int]:
    text, ids = get_input("text_input"), get_input("input_ids")
    if text is None and ids is None:
        raise ValueError("missing input: send text_input (one string) or input_ids (token ids)")
    if text is not None and ids is not None:
        raise ValueError("send either text_input or input_ids, not both")
    if ids is not None:
        flat = np.asarray(ids).reshape(-1)
        if flat.size == 0:
            raise ValueError("input_ids must hold at least one token id")
        return [int(t) for t in flat]
    value = _one_text(text, "text_input must hold exactly one string", "text_input must be UTF-8 text")
    if not isinstance(value, str) or not value:
        raise ValueError("text_input must be a non-empty string")
    return value


def _flag(get_input: GetInput, name: str, default: bool | None) -> bool | None:
    tensor = get_input(name)
    if tensor is None:
        return default
    flat = np.asarray(tensor).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"{name} must be one boolean, got {flat.size} values")
    return bool(flat[0])


def _sampling_tensor(get_input: GetInput) -> dict[str, Any]:
    tensor = get_input("sampling_parameters")
    if tensor is None:
        return {}
    raw = _one_text(tensor, "sampling_parameters must be one JSON string",
                    "sampling_parameters must be UTF-8 text (a JSON object)")
    return _json_object(str(raw), "sampling_parameters")


def _one_text(tensor, count_message: str, utf8_message: str):
    """The one element of a BYTES tensor, decoded when it is bytes; ValueError with the messages given."""
    flat = np.asarray(tensor, dtype=object).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"{count_message}, got {flat.size}")
    value = flat[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(utf8_message) from None
    return value


def _json_object(raw: str | None, name: str) -> dict[str, Any]:
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: malformed JSON ({err.msg} at position {err.pos})") from None
    except RecursionError:
        raise ValueError(f"{name}: JSON nested too deeply; send a flat object of sampling settings") from None
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise ValueError(f"{name}: a value is out of range ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def sampling_params(request_parameters: dict[str, Any], tensor_values: dict[str, Any]) -> SamplingParams:
    """Merge the request's parameters with the sampling_parameters tensor (which wins); vLLM names."""
    # Triton's own request parameters (triton_*) are not sampling settings.
    merged = {k: v for k, v in request_parameters.items() if not k.startswith("triton_")}
    merged.update(tensor_values)
    merged = translate_vllm_keys(merged)
    coerced = {key: _coerce(key, value) for key, value in merged.items()}
    try:
        return SamplingParams.from_dict(coerced)
    except TypeError as err:  # e.g. a wrongly typed list
        raise ValueError(f"sampling_parameters: {err}") from None


def _coerce(key: str, value: Any) -> Any:
    """vLLM clients often send numbers as strings ({"temperature": "0.1"}): accept them."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if key in _INT_FIELDS:
            return int(text)
        if key in _FLOAT_FIELDS:
            return float(text)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {value!r}") from None
    if key in _BOOL_FIELDS:
        return parse_bool(key, value)
    return value


def response_arrays(req: ParsedRequest, outs: list[Any], prefix: str = "",
                    decode_token: Callable[[int], str] = str, new: int | None = None,
                    cumulative: list[float] | None = None) -> dict[str, np.ndarray]:
    """Tensors for one response, one entry per sample (n > 1: the sample's newest output in outs[i], or None): the
    delta of sample `new` when streaming (the other samples' entries empty), everything (after `prefix`) at the
    end otherwise.

    decode_token: a token id's text, for the logprobs output's decoded_token; cumulative: each sample's logprob sum
    so far when the caller keeps it (else it is summed here)."""
    texts, id_lists, logprob_lists, reasons, totals = _sample_parts(req, outs, prefix, new, cumulative)
    arrays = {"text_output": np.array([t.encode("utf-8") for t in texts], dtype=np.object_)}
    if req.return_finish_reason:
        arrays["finish_reason"] = np.array([r.encode() for r in reasons], dtype=np.object_)
    # token counts are UINT32, as the vLLM backend sends them (Triton's OpenAI frontend reads usage from UINT32 only)
    if req.return_num_input_tokens:
        first = next(out for out in outs if out is not None)
        arrays["num_input_tokens"] = np.array([first.num_prompt_tokens], dtype=np.uint32)
    if req.return_num_output_tokens:
        arrays["num_output_tokens"] = np.array([len(ids) for ids in id_lists], dtype=np.uint32)
    if req.return_cumulative_logprob:  # the sum over every output token so far, also when streaming
        arrays["cumulative_logprob"] = np.array(cumulative if cumulative is not None else totals, dtype=np.float32)
    if req.return_output_ids:
        arrays["output_ids"] = _output_ids(id_lists)
    if req.return_logprobs:
        arrays["logprobs"] = np.array(
            [json.dumps(vllm_logprobs(lps, decode_token) if req.asked_logprobs else None).encode()
             for lps in logprob_lists], dtype=np.object_)
    return arrays


def _sample_parts(req: ParsedRequest, outs: list[Any], prefix: str, new: int | None,
                  cumulative: list[float] | None) -> tuple[list, list, list, list, list]:
    """Per sample: its text, token ids, logprobs and finish reason for this response, and its logprob sum where
    the caller keeps none (response_arrays says which part of each output a response carries)."""
    texts, id_lists, logprob_lists, reasons, totals = [], [], [], [], []
    for i, out in enumerate(outs):
        if out is None or (req.stream and i != new):  # streaming: nothing new for this sample
            texts.append(""), id_lists.append([]), logprob_lists.append([])
        elif req.stream:
            texts.append(out.delta_text), id_lists.append(out.delta_token_ids)
            logprob_lists.append(out.delta_logprobs or [])
        else:
            texts.append(prefix + out.text), id_lists.append(out.token_ids), logprob_lists.append(out.logprobs or [])
        # "None" until the sample's last response, as the vLLM backend sends str(None)
        reasons.append(out.finish_reason if out is not None and out.finished and out.finish_reason else "None")
        if req.return_cumulative_logprob and cumulative is None:
            totals.append(sum(entry["logprob"] for entry in out.logprobs or ()) if out is not None else 0.0)
    return texts, id_lists, logprob_lists, reasons, totals


def _output_ids(id_lists: list[list[int]]) -> np.ndarray:
    """One sample's ids; n samples' as rows of one width, padded with -1, back to back (reshape to (n, -1))."""
    if len(id_lists) == 1:
        return np.asarray(id_lists[0], dtype=np.int64).reshape(-1)
    width = max(map(len, id_lists))
    return np.array([t for ids in id_lists for t in ids + [-1] * (width - len(ids))], dtype=np.int64)


def vllm_logprobs(entries: list[dict], decode_token: Callable[[int], str]) -> list[dict[str, dict]]:
    """The vLLM backend's logprobs: per new token, {token id (a string): {logprob, rank, decoded_token}} for the
    sampled token and its top-n alternatives (the sampled token may be one of them)."""
    converted = []
    for entry in entries:
        tokens = {str(alt["token_id"]): _logprob(alt, decode_token) for alt in entry.get("top_logprobs") or ()}
        tokens.setdefault(str(entry["token_id"]), _logprob(entry, decode_token))
        converted.append(tokens)
    return converted


def _logprob(entry: dict, decode_token: Callable[[int], str]) -> dict:
    return {"logprob": entry["logprob"], "rank": entry["rank"], "decoded_token": decode_token(entry["token_id"])}
