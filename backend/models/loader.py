"""load_model: a local safetensors checkpoint folder -> LlamaFamilyModel with fused weights on the device."""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from backend.config import KV_CACHE_DTYPES, QUANTIZATIONS
from backend.models.fp8_weights import FP8Weight, fuse, quantize_on_device
from backend.models.llama import ROTARY_CLASSES, LayerWeights, LlamaFamilyModel, build_cos_sin_cache
from backend.models.quantized_checkpoint import (
    CheckpointQuantization,
    check_kv_cache_scheme,
    read_kv_scales,
    read_linear,
    read_quantization,
)
from backend.models.random_model import is_random_checkpoint, random_weights
from backend.models.spec import ModelSpec
from backend.ops import fp8, get_ops

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = tuple(ROTARY_CLASSES)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def load_model(path: str, dtype=torch.float32, device="cpu", attention_backend: str = "torch",
               linear_backend: str = "auto", dependent_launch: bool = False, quantization: str = "none",
               kv_cache_dtype: str = "auto") -> LlamaFamilyModel:
    """Read config.json and *.safetensors from `path`; never runs remote code or unpickles weights.
    dependent_launch: the model's Triton kernels launch as programmatic dependents.
    quantization: "none" keeps the linear weights as the checkpoint stores them (an FP8 checkpoint's stay FP8,
    backend/models/quantized_checkpoint.py); "fp8" quantizes a checkpoint without a quantization_config to e4m3 with
    per-output-channel scales as it loads, one weight at a time on the device (an FP8 checkpoint loads as with
    "none"). Embeddings, LM head and norms stay in dtype.
    kv_cache_dtype: "fp8" gives each layer the [k_scale, v_scale] of an FP8 KV cache (the checkpoint's where it
    holds them, else 1.0); "auto" gives none."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    folder = Path(path)
    device = torch.device(device)
    dtype = _resolve_dtype(dtype, device)
    config = _read_config(folder)
    quant = read_quantization(_raw_config(folder))
    if kv_cache_dtype == "fp8":
        check_kv_cache_scheme(quant)
    spec = _make_spec(config, folder, dtype)
    if attention_backend == "auto":
        attention_backend = "triton" if device.type == "cuda" else "torch"
    ops = get_ops(attention_backend, linear_backend, dependent_launch)
    # a pre-quantized checkpoint's own choice of the layers it leaves wide (its ignore list) stands
    quantize = quantization == "fp8" and quant is None
    weights, kv_scales = _read_weights(folder, config, spec, dtype, device, quant, quantize)
    if kv_cache_dtype == "fp8":
        _set_kv_scales(weights["layers"], kv_scales, device)
    cos_sin = build_cos_sin_cache(config, spec.model_type, spec.head_dim, device)
    model = LlamaFamilyModel(spec, ops, cos_sin_cache=cos_sin, eps=float(config.rms_norm_eps), **weights)
    linears = f"FP8 linears ({quant.scheme})" if quant else "FP8 linears (quantized on load)" if quantize else dtype
    logger.info("loaded %s (%d layers, %s, %s, KV cache %s) from %s with %s ops",
                spec.model_type, spec.num_layers, dtype, linears, kv_cache_dtype, path, ops.name)
    return model.eval()


def _read_weights(folder: Path, config, spec, dtype, device, quant, quantize: bool) -> tuple[dict, list]:
    """The model's weights (random ones drawn on the device for a random checkpoint) and each layer's
    checkpoint KV scales (None where it holds none)."""
    if is_random_checkpoint(folder):
        return random_weights(folder, config, spec, dtype, device, quantize=quantize), [None] * spec.num_layers
    with _Checkpoint(folder) as ckpt:
        weights = _load_weights(ckpt, config, spec, dtype, device, quant, quantize)
        return weights, [read_kv_scales(ckpt, f"layers.{i}.self_attn.") for i in range(spec.num_layers)]


def _set_kv_scales(layers: list[LayerWeights], found: list[tuple[float, float] | None], device) -> None:
    """Each layer's kv_scale (2,) float32 [k_scale, v_scale]: the checkpoint's, else 1.0 (values cached as they are,
    which suits activations well inside e4m3's ±448)."""
    for layer, scales in zip(layers, found):
        layer.kv_scale = torch.tensor(scales or (1.0, 1.0), dtype=torch.float32, device=device)  # (2,)
    missing = sum(s is None for s in found)
    if missing:
        logger.info("FP8 KV cache: %d of %d layers have no k_scale/v_scale in the checkpoint; they use 1.0",
                    missing, len(found))


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_DTYPES.values():
            raise ValueError(f"dtype must be one of {list(TORCH_DTYPES)}, got {dtype}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {list(TORCH_DTYPES)}, got {dtype!r}")
    return TORCH_DTYPES[dtype]


def _raw_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a checkpoint folder: config.json is missing")
    return json.loads(config_file.read_text())


def _read_config(folder: Path):
    """AutoConfig of a supported family; the model_type is checked first so unknown types fail clearly."""
    model_type = _raw_config(folder).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    from transformers import AutoConfig  # heavy import, only when loading

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act {config.hidden_act!r} is unsupported; only silu")
    _check_sliding_window(config, model_type)
    return config


def _check_sliding_window(config, model_type: str) -> None:
    """We attend over the full context, which equals sliding-window attention only while the window covers it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    uses_window = model_type == "mistral" or getattr(config, "use_sliding_window", False) or (
        "sliding_attention" in layer_types
    )
    if uses_window and window is not None and window < config.max_position_embeddings:
        raise ValueError(
            f"sliding-window attention (window {window} < max_position_embeddings "
            f"{config.max_position_embeddings}) is unsupported; only full attention is implemented"
        )


def _make_spec(config, folder: Path, dtype: torch.dtype) -> ModelSpec:
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelSpec(
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        eos_token_ids=_eos_token_ids(config, folder),
        dtype=dtype,
        model_type=config.model_type,
    )


def _eos_token_ids(config, folder: Path) -> tuple[int, ...]:
    """generation_config.json wins over config.json; either may hold an int, a list or nothing."""
    eos = None
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))  # unique, order kept


class _Checkpoint(contextlib.ExitStack):
    """Tensors by HF name across the folder's safetensors files (the "model." prefix stripped)."""

    def __init__(self, folder: Path):
        super().__init__()
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
            if pickles:
                raise ValueError(
                    f"{folder} holds only pickle weights ({', '.join(pickles)}); pickles are never loaded: "
                    "convert the checkpoint to safetensors (save_pretrained(..., safe_serialization=True))"
                )
            raise ValueError(f"{folder} holds no *.safetensors weight files")
        self._files = files
        self._index: dict[str, tuple[object, str]] = {}

    def __enter__(self):
        super().__enter__()
        for f in self._files:
            handle = self.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for key in handle.keys():
                name = key[len("model."):] if key.startswith("model.") else key
                self._index[name] = (handle, key)
        return self

    def has(self, name: str) -> bool:
        return name in self._index

    def get(self, name: str) -> torch.Tensor:
        if name not in self._index:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        handle, key = self._index[name]
        return handle.get_tensor(key)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None


def _load_weights(ckpt: _Checkpoint, config, spec: ModelSpec, dtype, device,
                  quant: CheckpointQuantization | None, quantize: bool) -> dict:
    """HF tensors -> the model's fused tensors, one layer at a time so peak host memory stays one layer.

    Linear weights the checkpoint stores in FP8 stay FP8; with quantize, those it stores wide are quantized on the
    device, one at a time. Embeddings, the LM head and the norms are always in dtype: the LM head's output is the
    logits themselves, so its error would go straight into the sampled distribution; the embedding is a gather of a
    few rows a token, not a GEMM streaming the whole matrix, so FP8 would save no bandwidth; norms are tiny."""
    reader = _WeightReader(ckpt, dtype, device, quant, quantize)
    layers = [reader.layer(i, spec) for i in range(spec.num_layers)]
    if reader.requantized:
        logger.warning("%d fused FP8 weights (%s) were requantized per 128 x 128 block: their parts' rows are not "
                       "multiples of 128, so the fused blocks would straddle two parts' scales; they differ from the "
                       "checkpoint by up to one more e4m3 rounding", len(reader.requantized),
                       ", ".join(sorted(set(reader.requantized))))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return dict(
        embed=reader.wide("embed_tokens"),
        layers=layers,
        final_norm=reader.put("norm.weight"),
        lm_head=None if tied else reader.wide("lm_head"),
    )


class _WeightReader:
    """Reads a checkpoint's tensors onto the device in the model's layout: dtype for norms, biases and wide
    matrices, fused FP8 (weight, scale) pairs for linears stored in FP8 or quantized on load."""

    def __init__(self, ckpt: _Checkpoint, dtype, device, quant: CheckpointQuantization | None, quantize: bool):
        self._ckpt, self._dtype, self._device = ckpt, dtype, device
        self._quant, self._quantize = quant, quantize
        self.requantized: list[str] = []  # fused FP8 weights requantized per block (logged once)

    def put(self, name: str, required: bool = True) -> torch.Tensor | None:
        t = self._ckpt.get(name) if required else self._ckpt.maybe(name)
        if t is None:
            return None
        if t.dtype.itemsize == 1:
            raise ValueError(f"{name} is stored as {t.dtype}; only linear weights are read quantized")
        return t.to(dtype=self._dtype).to(self._device).contiguous()

    def cat_biases(self, names: list[str]) -> torch.Tensor | None:
        if not all(self._ckpt.has(n) for n in names):
            if any(self._ckpt.has(n) for n in names):
                raise ValueError(f"checkpoint has only some of {names}")
            return None
        return torch.cat([self.put(n) for n in names], dim=0)

    def wide(self, name: str) -> torch.Tensor:
        """A matrix kept in dtype; an FP8 one (e.g. an LM head a checkpoint did not leave out) is dequantized."""
        w = read_linear(self._ckpt, name, self._quant)
        if isinstance(w, FP8Weight):
            w = w.to(self._device)
            return fp8.dequantize(w.weight, w.scale, self._dtype)
        return w.to(dtype=self._dtype).to(self._device).contiguous()

    def linear(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """These linears fused along N: (weight (N, K), its scales or None)."""
        parts = [read_linear(self._ckpt, n, self._quant) for n in names]
        stored = [p for p in parts if isinstance(p, FP8Weight)]
        if stored and len(stored) != len(parts):
            raise ValueError(f"checkpoint stores only some of {names} in FP8; a fused weight must be all one kind")
        if stored:
            fused, again = fuse(stored, names)
            if again:
                self.requantized.append("+".join(n.rsplit(".", 1)[-1] for n in names))
            fused = fused.to(self._device)
            return fused.weight, fused.scale
        w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # (N, K) in the checkpoint's dtype
        if self._quantize:  # from the checkpoint's own values, the wide copy on the device one weight at a time
            q = quantize_on_device(w, self._device)
            return q.weight, q.scale
        return w.to(dtype=self._dtype).to(self._device).contiguous(), None

    def layer(self, i: int, spec: ModelSpec) -> LayerWeights:
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = [attn + f"{x}_proj" for x in "qkv"]
        gate_up = [mlp + "gate_proj", mlp + "up_proj"]
        qkv_weight, qkv_scale = self.linear(qkv)
        o_weight, o_scale = self.linear([attn + "o_proj"])
        gate_up_weight, gate_up_scale = self.linear(gate_up)
        down_weight, down_scale = self.linear([mlp + "down_proj"])
        qk_norms = spec.model_type == "qwen3"
        return LayerWeights(
            qkv_weight=qkv_weight, qkv_bias=self.cat_biases([n + ".bias" for n in qkv]), qkv_scale=qkv_scale,
            o_weight=o_weight, o_bias=self.put(attn + "o_proj.bias", required=False), o_scale=o_scale,
            gate_up_weight=gate_up_weight, gate_up_bias=self.cat_biases([n + ".bias" for n in gate_up]),
            gate_up_scale=gate_up_scale,
            down_weight=down_weight, down_bias=self.put(mlp + "down_proj.bias", required=False),
            down_scale=down_scale,
            input_norm=self.put(p + "input_layernorm.weight"),
            post_norm=self.put(p + "post_attention_layernorm.weight"),
            q_norm=self.put(attn + "q_norm.weight") if qk_norms else None,
            k_norm=self.put(attn + "k_norm.weight") if qk_norms else None,
        )
