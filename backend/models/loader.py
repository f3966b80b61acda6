"""load_model: a local safetensors checkpoint folder -> LlamaFamilyModel with fused weights on the device."""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from backend.models.llama import ROTARY_CLASSES, LayerWeights, LlamaFamilyModel, build_cos_sin_cache
from backend.models.random_model import is_random_checkpoint, random_weights
from backend.models.spec import ModelSpec
from backend.ops import get_ops

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = tuple(ROTARY_CLASSES)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def load_model(path: str, dtype=torch.float32, device="cpu", attention_backend: str = "torch",
               linear_backend: str = "auto", dependent_launch: bool = False) -> LlamaFamilyModel:
    """Read config.json and *.safetensors from `path`; never runs remote code or unpickles weights.
    dependent_launch: the model's Triton kernels launch as programmatic dependents."""
    folder = Path(path)
    device = torch.device(device)
    dtype = _resolve_dtype(dtype, device)
    config = _read_config(folder)
    spec = _make_spec(config, folder, dtype)
    if attention_backend == "auto":
        attention_backend = "triton" if device.type == "cuda" else "torch"
    ops = get_ops(attention_backend, linear_backend, dependent_launch)
    if is_random_checkpoint(folder):
        weights = random_weights(folder, config, spec, dtype, device)
    else:
        with _Checkpoint(folder) as ckpt:
            weights = _load_weights(ckpt, config, spec, dtype, device)
    cos_sin = build_cos_sin_cache(config, spec.model_type, spec.head_dim, device)
    model = LlamaFamilyModel(spec, ops, cos_sin_cache=cos_sin, eps=float(config.rms_norm_eps), **weights)
    logger.info("loaded %s (%d layers, %s) from %s with %s ops",
                spec.model_type, spec.num_layers, dtype, path, ops.name)
    return model.eval()


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


def _read_config(folder: Path):
    """AutoConfig of a supported family; the model_type is checked first so unknown types fail clearly."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a checkpoint folder: config.json is missing")
    model_type = json.loads(config_file.read_text()).get("model_type")
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


def _load_weights(ckpt: _Checkpoint, config, spec: ModelSpec, dtype, device) -> dict:
    """HF tensors -> the model's fused tensors, one layer at a time so peak host memory stays one layer."""

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype=dtype).to(device).contiguous()

    def cat(names: list[str], required: bool = True) -> torch.Tensor | None:
        if not required and not all(ckpt.has(n) for n in names):
            if any(ckpt.has(n) for n in names):
                raise ValueError(f"checkpoint has only some of {names}")
            return None
        return put(torch.cat([ckpt.get(n) for n in names], dim=0))

    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = [attn + f"{x}_proj" for x in "qkv"]
        gate_up = [mlp + "gate_proj", mlp + "up_proj"]
        layers.append(
            LayerWeights(
                qkv_weight=cat([n + ".weight" for n in qkv]),
                qkv_bias=cat([n + ".bias" for n in qkv], required=False),
                o_weight=put(ckpt.get(attn + "o_proj.weight")),
                o_bias=put(ckpt.maybe(attn + "o_proj.bias")),
                gate_up_weight=cat([n + ".weight" for n in gate_up]),
                gate_up_bias=cat([n + ".bias" for n in gate_up], required=False),
                down_weight=put(ckpt.get(mlp + "down_proj.weight")),
                down_bias=put(ckpt.maybe(mlp + "down_proj.bias")),
                input_norm=put(ckpt.get(p + "input_layernorm.weight")),
                post_norm=put(ckpt.get(p + "post_attention_layernorm.weight")),
                q_norm=put(ckpt.get(attn + "q_norm.weight")) if spec.model_type == "qwen3" else None,
                k_norm=put(ckpt.get(attn + "k_norm.weight")) if spec.model_type == "qwen3" else None,
            )
        )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return dict(
        embed=put(ckpt.get("embed_tokens.weight")),
        layers=layers,
        final_norm=put(ckpt.get("norm.weight")),
        lm_head=None if tied else put(ckpt.get("lm_head.weight")),
    )
