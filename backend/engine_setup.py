"""Builds an engine's parts from its config: device, model, tokenizer, KV cache, scheduler, runner."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from backend.config import EngineConfig
from backend.core.kv_cache import BlockManager
from backend.models import BUILT_IN_MODELS, load_model, resolve_model_path
from backend.models.loader import TORCH_DTYPES
from backend.ops import fp8
from backend.executor.pipeline import SlotLayout
from backend.request import MAX_LOGPROBS
from backend.executor.runner import ModelRunner
from backend.executor.step_ops import StepOps
from backend.ops import get_ops
from backend.core.scheduler import Scheduler
from backend.runtime.timeline import Timeline

log = logging.getLogger("tandem.engine")

_DEFAULT_MAX_LEN_CAP = 32768


@dataclass
class DraftParts:
    """The draft model of speculative_method draft, and its own KV cache (as many blocks as the model's)."""

    model: object
    kv_cache: torch.Tensor | None
    block_size: int
    target_vocab_size: int  # the model's: the draft never proposes a token past it
    num_tokens: int  # num_speculative_tokens: what every drafting step proposes a row
    max_rows: int  # max_num_seqs: the most rows a step drafts for


@dataclass
class EngineParts:
    """Everything the engine loop works with."""

    device: torch.device
    dtype: torch.dtype
    model: object
    tokenizer: object
    max_model_len: int
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    timeline: Timeline
    async_pipeline: bool
    kv_cache_dtype: torch.dtype  # the model's dtype, or FP8 (e4m3) for kv_cache_dtype fp8
    draft: DraftParts | None = None  # speculative_method draft's model


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available on this machine")
    return device


def device_scope(device: torch.device):
    """Make device the thread's current CUDA device: Triton kernels, default streams and events use it, so an
    engine on cuda:1 must not launch them on cuda:0 (a new thread starts on device 0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()




def build_engine_parts(config: EngineConfig, model=None, tokenizer=None) -> EngineParts:
    """Load what config names; a ready model and tokenizer may be given instead (tests, benchmarks)."""
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with device_scope(device):
        return _build_on(device, config, model, tokenizer)


def _build_on(device: torch.device, config: EngineConfig, model, tokenizer) -> EngineParts:
    dtype = TORCH_DTYPES.get(config.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    path, step_ops = "<given model>", None  # a given model's steps all launch with its own ops
    if model is None:
        path, model, tokenizer, step_ops = _load(device, config, dtype, backend)
    spec = model.spec
    max_len = config.max_model_len or min(spec.max_position_embeddings, _DEFAULT_MAX_LEN_CAP)
    if max_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len ({max_len}) exceeds the model's maximum ({spec.max_position_embeddings})")
    kv_dtype = _kv_cache_dtype(config, model, dtype)
    draft = _load_draft(device, config, dtype, backend, spec, tokenizer) if config.speculative_method == "draft" else None
    num_blocks = _num_kv_blocks(config, spec, kv_dtype, device, draft)
    kv_cache = torch.zeros(spec.kv_cache_shape(num_blocks, config.block_size), dtype=kv_dtype,
                           device=device)  # (L, 2, NB, BS, Hkv, D)
    if draft is not None:
        draft.kv_cache = torch.zeros(draft.model.spec.kv_cache_shape(num_blocks, config.block_size), dtype=dtype,
                                     device=device)
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens, max_len)
    timeline = Timeline(config.timeline, use_cuda=device.type == "cuda")
    # a drafting row samples its token and each draft: a step's logits rows may outnumber its requests
    drafted_rows = config.max_num_seqs * (1 + config.num_speculative_tokens) if config.speculative_method else 0
    layout = SlotLayout(max_tokens=config.max_num_batched_tokens, max_seqs=config.max_num_seqs,
                        max_blocks=-(-max_len // config.block_size), max_logprobs=MAX_LOGPROBS,
                        max_rows=min(drafted_rows, config.max_num_batched_tokens))
    runner = ModelRunner(model, kv_cache, config.block_size, layout, device, timeline,
                         use_graphs=config.cuda_graphs, max_graph_batch=config.max_graph_batch_size,
                         fused_sampler=config.fused_sampler, mixed_graphs=config.mixed_step_graphs,
                         step_ops=step_ops)
    runner.prepare(measure_graph_idle=config.graph_idle_measure)
    async_pipeline = config.async_pipeline if config.async_pipeline is not None else device.type == "cuda"
    log.info("engine: %s on %s (%s), %d KV blocks of %d tokens (%s), max_model_len %d, attention %s, async %s",
             path, device, dtype, num_blocks, config.block_size, kv_dtype, max_len, backend, async_pipeline)
    return EngineParts(device, dtype, model, tokenizer, max_len, block_manager, scheduler, runner, timeline,
                       async_pipeline, kv_dtype, draft)


def _load(device: torch.device, config: EngineConfig, dtype: torch.dtype, backend: str):
    """(path, model, tokenizer, step ops or None) of config.model: a built-in model (e.g. the stand-in, to time the
    engine's own work) or a checkpoint, whose decode steps may launch as programmatic dependents (StepOps)."""
    if config.model in BUILT_IN_MODELS:
        return (config.model, *BUILT_IN_MODELS[config.model](device), None)
    from transformers import AutoTokenizer

    path = resolve_model_path(config.model, config.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dependent = _dependent_launch(config.dependent_launch, backend, device)
    model = load_model(path, dtype=dtype, device=device, attention_backend=backend,
                       linear_backend=config.linear_backend, dependent_launch=dependent,
                       quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype)
    step_ops = None
    if dependent and config.dependent_launch in ("auto", "decode"):
        step_ops = StepOps(model.ops, get_ops(backend, config.linear_backend, False), config.dependent_decode_rows)
    return path, model, tokenizer, step_ops


def _load_draft(device: torch.device, config: EngineConfig, dtype: torch.dtype, backend: str, spec,
                tokenizer) -> DraftParts:
    """speculative_draft_model, loaded as the model is but unquantized and without dependent launch (it is small),
    once it is known to share the model's tokenizer; its KV cache comes once the model's block count is known."""
    from transformers import AutoTokenizer

    path = resolve_model_path(config.speculative_draft_model, config.cache_dir)
    _check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(path), path)
    model = load_model(path, dtype=dtype, device=device, attention_backend=backend,
                       linear_backend=config.linear_backend)
    return DraftParts(model, None, config.block_size, spec.vocab_size, config.num_speculative_tokens,
                      config.max_num_seqs)


def _check_same_tokenizer(tokenizer, draft_tokenizer, path: str) -> None:
    """A draft model's tokens mean the same text as the model's, or its drafts are noise: same vocabulary."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours != theirs:
        differ = sum(1 for text, i in theirs.items() if ours.get(text) != i) + len(set(ours) - set(theirs))
        raise ValueError(f"speculative_draft_model {path!r} has another tokenizer than the model: {len(theirs)} "
                         f"tokens against {len(ours)}, {differ} of them differ; a draft model must share it")


def _kv_cache_dtype(config: EngineConfig, model, dtype: torch.dtype) -> torch.dtype:
    """The KV tensor's dtype: the model's, or e4m3 for kv_cache_dtype fp8, whose layers must then carry their
    kv_scale (the loader sets them; without one the attention ops would refuse the FP8 cache mid-step)."""
    if config.kv_cache_dtype != "fp8":
        return dtype
    missing = [i for i, layer in enumerate(getattr(model, "layers", ())) if getattr(layer, "kv_scale", None) is None]
    if missing:
        raise ValueError(f"kv_cache_dtype fp8 needs every layer's kv_scale; layers {missing} have none")
    return fp8.FP8_DTYPE


def _dependent_launch(setting: str, backend: str, device: torch.device) -> bool:
    """Whether the model's Triton kernels launch as programmatic dependents: on and decode (which leaves mixed steps
    and decode steps of more than dependent_decode_rows rows plain: StepOps) say so; auto is decode for the triton
    path on GPUs with programmatic dependent launch (compute capability 9.0+)."""
    if setting != "auto":
        return setting in ("on", "decode")
    return backend == "triton" and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _num_kv_blocks(config: EngineConfig, spec, kv_dtype: torch.dtype, device: torch.device,
                   draft: DraftParts | None = None) -> int:
    """Blocks from the config, or from free memory (CUDA) / the CPU byte budget at kv_dtype's element size (an FP8
    cache gets twice the blocks of a bf16 one); a draft model's cache takes as many blocks of its own size."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks + 1  # one more: block 0 is the reserved null block
    per_block = spec.kv_bytes_per_block(config.block_size, kv_dtype)
    if draft is not None:
        per_block += draft.model.spec.kv_bytes_per_block(config.block_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.kv_cache_memory_fraction) - (2 << 30)  # room for activations and graphs
    else:
        budget = config.kv_cache_cpu_bytes
    blocks = budget // per_block
    if blocks < 2:
        raise ValueError("not enough memory for the KV cache; lower max_model_len or set num_kv_blocks")
    return int(blocks)
