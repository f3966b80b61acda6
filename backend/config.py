"""EngineConfig: every engine setting, validated once with errors that say what to fix."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from backend.speculative.proposer import METHODS as SPECULATIVE_METHODS
from backend.text_values import parse_bool

DEFAULT_MODEL = "smollm2-135m-instruct"
_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True)
class EngineConfig:
    """Settings of one engine; call `validate()` (the Engine does) before use."""

    model: str = DEFAULT_MODEL  # local checkpoint folder (config.json + safetensors), the built-in alias,
    # random:<shape> (random weights, benchmarks) or stand-in (instant tokens: times the engine's or server's own work)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # none: weights as the checkpoint holds them (an FP8 checkpoint stays FP8); fp8: a checkpoint in a wider dtype is
    # quantized to FP8 (e4m3, per-output-channel scales) as it loads, layer by layer
    quantization: str = "none"
    kv_cache_dtype: str = "auto"  # auto: the model's dtype | fp8: e4m3 K and V with per-layer scales (half the bytes)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # fixed number of KV blocks; None: sized from memory
    kv_cache_memory_fraction: float = 0.85  # CUDA: share of free memory for KV blocks after weights
    kv_cache_cpu_bytes: int = 256 << 20  # CPU: bytes for KV blocks when num_kv_blocks is None
    max_num_seqs: int = 256  # most requests in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's own maximum, capped at 32768
    max_waiting_requests: int = 4096  # bounded queue: add_request beyond it raises EngineOverloaded
    enable_prefix_caching: bool = True
    async_pipeline: bool | None = None  # None: on where CUDA is present
    cuda_graphs: bool = True  # decode steps replay captured graphs on CUDA
    gc_freeze: bool = True  # after start-up, Python's garbage collector stops walking the objects alive then
    # objects allocated between two young-generation collections while the engine runs; 0 keeps Python's (700)
    gc_young_threshold: int = 50_000
    # build the structured-outputs library's tokenizer view at start-up, on a helper thread: ~0.5 s of GIL on a
    # 49k vocabulary that would otherwise stall running streams when the first structured request arrives
    grammar_warmup: bool = True
    loop_gate: bool = True  # CUDA: output/sender threads do their Python while the loop waits (loop_gate.py)
    max_graph_batch_size: int = 256  # largest decode batch with a captured graph
    mixed_step_graphs: bool = True  # triton attention: steps with prefill chunks replay graphs per token bucket
    graph_idle_measure: bool = True  # CUDA graphs: time each graph's inner idle once (CUPTI) so GPU busy is kernel time
    fused_sampler: bool = True  # triton ops: sampling in one kernel (captured per bucket); off: the torch sampler
    attention_backend: str = "auto"  # auto | torch | triton
    linear_backend: str = "auto"  # auto (measured table) | triton | cublas: decode GEMMs on the triton path
    # auto (decode on compute capability >= 9.0, else off) | decode (decode steps of at most dependent_decode_rows
    # rows) | on | off: triton kernels overlap
    dependent_launch: str = "auto"
    dependent_decode_rows: int = 96  # dependent_launch decode: larger decode steps launch plainly
    seed: int = 0  # seed for requests that bring none
    timeline: bool = False  # record CPU/GPU spans from the start (switchable at run time)
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    cache_dir: str | None = None  # where the built-in model is converted to safetensors
    # speculative decoding: "" (off), ngram, suffix or draft (backend/speculative); decode rows then feed up to
    # num_speculative_tokens drafted tokens a step, which the model checks in the same forward (a drafted step reads
    # the step before it first); speculative_adaptive: drafts only where and as far as they measurably pay
    # (speculative/draft_policy.py), else every row drafts k at every step
    speculative_method: str = ""
    num_speculative_tokens: int = 4
    speculative_adaptive: bool = True
    # speculative_method draft: the draft model (a checkpoint folder or an alias, as `model`), a smaller model with
    # the same tokenizer; it runs beside the model with its own KV cache of as many tokens
    speculative_draft_model: str = ""
    test_fault_every_n_steps: int = 0  # test hook: every n-th step raises (0 = off); never set in production

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineConfig":
        """Build from string-or-typed values (Triton parameters arrive as strings)."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in known:
                raise ValueError(f"unknown engine setting {key!r}; known settings: {', '.join(sorted(known))}")
            kwargs[key] = _coerce(key, raw, cls.__dataclass_fields__[key].default)
        return cls(**kwargs)

    def validate(self) -> "EngineConfig":
        """Raise ValueError naming the first wrong setting and what it accepts."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a checkpoint folder or the alias 'smollm2-135m-instruct'")
        for name, choices in (("dtype", _DTYPES), ("quantization", QUANTIZATIONS),
                              ("kv_cache_dtype", KV_CACHE_DTYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, got "
                                 f"{getattr(self, name)!r}")
        self._validate_sizes()
        for name, note in (("dependent_decode_rows", ""), ("gc_young_threshold", " (0: Python's own)")):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0{note}, got {value!r}")
        self._validate_speculation()
        if not isinstance(self.test_fault_every_n_steps, int) or self.test_fault_every_n_steps < 0:
            raise ValueError(f"test_fault_every_n_steps must be >= 0, got {self.test_fault_every_n_steps!r}")
        return self

    def _validate_speculation(self) -> None:
        """The proposer's name and the drafts a row may take."""
        if self.speculative_method not in ("", *SPECULATIVE_METHODS):
            raise ValueError(f"speculative_method must be empty (off) or one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != bool(self.speculative_draft_model):
            raise ValueError("speculative_draft_model (the draft checkpoint) is needed with speculative_method draft, "
                             f"and read only then; got method {self.speculative_method!r} and draft model "
                             f"{self.speculative_draft_model!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")

    def _validate_sizes(self) -> None:
        """The block, cache, batch and queue sizes."""
        _positive("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if not 0.0 < self.kv_cache_memory_fraction <= 0.98:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.98], got {self.kv_cache_memory_fraction}")
        for name in ("kv_cache_cpu_bytes", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests",
                     "max_graph_batch_size", "max_stop_strings", "max_stop_string_length"):
            _positive(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode in one step"
            )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)


# settings of a few named values, checked in this order after the model, dtype and device
_CHOICES = {
    "attention_backend": ("auto", "torch", "triton"),
    "linear_backend": ("auto", "triton", "cublas"),
    "dependent_launch": ("auto", "decode", "on", "off"),
}


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _coerce(key: str, raw: Any, default: Any) -> Any:
    """Turn a Triton string parameter into the type of the setting's default."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if isinstance(default, bool) or key in ("async_pipeline",):
        if text.lower() in ("", "none", "auto") and key == "async_pipeline":
            return None
        return parse_bool(key, raw)
    if isinstance(default, int) or key in ("num_kv_blocks", "max_model_len"):
        if text.lower() in ("", "none", "auto") and default is None:
            return None
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key} must be an integer, got {raw!r}") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key} must be a number, got {raw!r}") from None
    if default is None and text.lower() in ("", "none"):
        return None
    return text
