"""Sampling keys that Triton's vLLM backend takes and Tandem's SamplingParams has no field for.

Clients of that backend (Triton's OpenAI-compatible frontend among them) send them with every request: "best_of"
(= n), chat's "logprobs": false with "top_logprobs", nulls for unset fields, "structured_outputs" (or the older
"guided_decoding") as a JSON string. Each key is either translated to a
SamplingParams field, accepted where it asks for what Tandem does anyway, or refused with a message that says
why; a key no client of that backend sends stays an error in SamplingParams itself.
"""
from __future__ import annotations

from typing import Any

from backend.structured.spec import parse_structured_outputs
from backend.text_values import bool_word

# keys whose only value Tandem honours is the one vLLM defaults to
_DEFAULT_ONLY = {"detokenize": True, "spaces_between_special_tokens": True}
_STRUCTURED = ("structured_outputs", "guided_decoding")


def translate_vllm_keys(values: dict[str, Any]) -> dict[str, Any]:
    """values (the merged sampling parameters) with the vLLM-only keys checked and removed; raises ValueError.

    Null values mean "the default", as in the vLLM backend. "logprobs" may be a boolean (OpenAI chat): true asks
    for the sampled token's logprob plus "top_logprobs" alternatives, false for none."""
    out = {key: value for key, value in values.items() if value is not None}
    n = _integer(out.pop("n", 1), "n")
    best_of = _integer(out.pop("best_of", n), "best_of")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if best_of != n:
        raise ValueError(f"best_of ({best_of}) must equal n ({n}): every sample is returned, none is dropped")
    if n != 1:
        out["n"] = n
    # the vLLM backend has no output for prompt logprobs, so a client never sees them: nothing to compute
    if _integer(out.pop("prompt_logprobs", 0), "prompt_logprobs") < -1:
        raise ValueError("prompt_logprobs must be -1 or more")
    if out.get("truncate_prompt_tokens") in (-1, "-1"):  # vLLM: "up to the model's length", which prompts are anyway
        del out["truncate_prompt_tokens"]
    top = out.pop("top_logprobs", None)
    if "logprobs" in out:
        wanted = bool_word(out["logprobs"])
        if wanted is not None:
            if wanted:
                out["logprobs"] = _integer(top if top is not None else 0, "top_logprobs")
            else:
                del out["logprobs"]
        elif _integer(out["logprobs"], "logprobs") == -1:
            raise ValueError("logprobs: -1 (the whole vocabulary) is not supported; ask for at most 20")
    if out.pop("lora_name", None) is not None:
        raise ValueError("lora_name: LoRA is not enabled on this model (it serves its base weights only)")
    given = [key for key in _STRUCTURED if key in out]
    if len(given) > 1:
        raise ValueError("give structured_outputs or its older name guided_decoding, not both")
    if given:  # parsed here so an error names the key the client sent
        out["structured_outputs"] = parse_structured_outputs(out.pop(given[0]), given[0])
    for key, default in _DEFAULT_ONLY.items():
        if key in out and bool_word(out.pop(key)) is not default:
            raise ValueError(f"{key}: only {str(default).lower()} is supported")
    return out


def _integer(value: Any, key: str) -> int:
    """An int from a JSON number or numeric string (vLLM casts by field type); ValueError naming the key."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    try:
        number = int(value.strip()) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {value!r}") from None
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if not isinstance(number, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return number
