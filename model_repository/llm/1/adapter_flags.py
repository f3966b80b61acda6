"""The adapter's yes/no parameters of config.pbtxt, read strictly: a typo fails the model's load, naming the key."""
from __future__ import annotations

from backend.text_values import parse_bool


def adapter_flags(adapter: dict[str, str]) -> dict[str, bool]:
    """The adapter's yes/no parameters (the vLLM backend's ENABLE_VLLM_HEALTH_CHECK sets unload_on_engine_failure and
    wins over it); a value that is neither yes nor no fails the load, naming the parameter."""
    unload_key = "ENABLE_VLLM_HEALTH_CHECK" if "ENABLE_VLLM_HEALTH_CHECK" in adapter else "unload_on_engine_failure"
    try:
        return {"log_prompts": parse_bool("log_prompts", adapter.get("log_prompts", "false")),
                "REPORT_CUSTOM_METRICS": parse_bool("REPORT_CUSTOM_METRICS",
                                                   adapter.get("REPORT_CUSTOM_METRICS", "false")),
                "unload_on_engine_failure": parse_bool(unload_key, adapter.get(unload_key, "true"))}
    except ValueError as err:
        raise ValueError(f"config.pbtxt parameters: {err}") from None
