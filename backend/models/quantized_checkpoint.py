"""Pre-quantized FP8 checkpoints: the scheme config.json's quantization_config names, each linear's e4m3 weight with
its scales in a layout backend/ops/fp8.py takes, and the KV cache's per-layer scales.

Two formats are read, the ones published FP8 checkpoints use:
- quant_method "compressed-tensors" (format "float-quantized" or "naive-quantized"): 8-bit float weights with
  strategy "channel" (weight_scale (N, 1)), "tensor" (weight_scale of one element) or "block" with
  block_structure [128, 128] (weight_scale (ceil(N/128), ceil(K/128)));
- quant_method "fp8": "weight_block_size" [128, 128] gives block scales named weight_scale_inv (despite the name
  they multiply, as every scale here does), none gives one weight_scale per tensor.
Layers a checkpoint leaves unquantized (compressed-tensors' "ignore", e.g. lm_head) are stored in a wider dtype and
read as such. A static activation scale (input_scale) is not used: activations are scaled per token at run time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.models.fp8_weights import FP8Weight
from backend.ops import fp8

SUPPORTED = ("compressed-tensors with 8-bit float weights (format float-quantized or naive-quantized; strategy "
             "channel, tensor, or block with block_structure [128, 128]), or quant_method fp8 (fmt e4m3; per-tensor, "
             "or weight_block_size [128, 128])")
_CT_FORMATS = ("float-quantized", "naive-quantized")
_BLOCK = [fp8.WEIGHT_BLOCK, fp8.WEIGHT_BLOCK]
# where FP8 checkpoints keep a layer's KV-cache scales, under "layers.<i>.self_attn."
_KV_SCALE_NAMES = (("k_scale", "v_scale"), ("k_proj.output_scale", "v_proj.output_scale"))
# dtypes of other quantization schemes' packed weights: never read as plain weights
_PACKED_DTYPES = (torch.float8_e5m2, torch.int8, torch.uint8, torch.int32)


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """How a pre-quantized checkpoint stores its FP8 linear weights."""

    scheme: str  # for messages, e.g. "compressed-tensors (channel)"
    layouts: frozenset[str]  # the scale layouts its weights may use: "tensor", "channel", "block"
    scale_name: str  # the scale tensor beside "<layer>.weight": weight_scale or weight_scale_inv
    kv_cache_scheme: dict | None  # compressed-tensors' kv_cache_scheme, when it has one


def read_quantization(raw_config: dict) -> CheckpointQuantization | None:
    """config.json (as a dict) -> its FP8 scheme, None for an unquantized checkpoint; ValueError for any other."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _hf_fp8(qc)
    raise ValueError(f"checkpoint quantization {method!r} is unsupported; supported: {SUPPORTED}")


def _unsupported(scheme: str) -> ValueError:
    return ValueError(f"checkpoint quantization {scheme} is unsupported; supported: {SUPPORTED}")


def _compressed_tensors(qc: dict) -> CheckpointQuantization:
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _unsupported(f"compressed-tensors with sparsity format {sparsity.get('format')!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _unsupported("compressed-tensors without config_groups")
    strategies = set()
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise _unsupported(f"compressed-tensors format {fmt!r} (group {name!r})")
        w = group.get("weights") or {}
        bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
        what = f"compressed-tensors weights {{num_bits {bits}, type {kind!r}, strategy {strategy!r}}} (group {name!r})"
        if bits != 8 or kind != "float" or w.get("symmetric", True) is not True or w.get("dynamic"):
            raise _unsupported(what)
        if strategy == "block":
            if list(w.get("block_structure") or []) != _BLOCK:
                raise _unsupported(f"compressed-tensors block_structure {w.get('block_structure')} (group {name!r})")
        elif strategy not in ("channel", "tensor"):
            raise _unsupported(what)
        acts = group.get("input_activations")
        if acts and (acts.get("num_bits") != 8 or acts.get("type") != "float"):
            raise _unsupported(f"compressed-tensors input_activations {{num_bits {acts.get('num_bits')}, "
                               f"type {acts.get('type')!r}}} (group {name!r})")
        strategies.add(strategy)
    return CheckpointQuantization(
        scheme=f"compressed-tensors ({', '.join(sorted(strategies))})",
        layouts=frozenset(strategies),
        scale_name="weight_scale",
        kv_cache_scheme=qc.get("kv_cache_scheme"),
    )


def _hf_fp8(qc: dict) -> CheckpointQuantization:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"fp8 with fmt {fmt!r}")
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise _unsupported(f"fp8 with activation_scheme {activations!r}")
    block = qc.get("weight_block_size")
    if block is None:
        return CheckpointQuantization("fp8 (per-tensor)", frozenset({"tensor"}), "weight_scale", None)
    if list(block) != _BLOCK:
        raise _unsupported(f"fp8 with weight_block_size {list(block)}")
    return CheckpointQuantization("fp8 (128x128 blocks)", frozenset({"block"}), "weight_scale_inv", None)


def read_linear(ckpt, name: str, quant: CheckpointQuantization | None) -> torch.Tensor | FP8Weight:
    """The linear `name`'s weight (N, K) on the CPU: as stored when wide, an FP8Weight when stored in e4m3.

    ckpt: has(name) / get(name) over the checkpoint's tensors. A per-tensor scale becomes (N,) per output channel,
    every row the same: exact."""
    weight = ckpt.get(name + ".weight")
    if weight.dtype in _PACKED_DTYPES:
        raise ValueError(f"{name}.weight is stored as {weight.dtype}; quantized weights are read only as FP8 e4m3 "
                         f"({SUPPORTED})")
    if not fp8.is_fp8(weight):
        return weight
    if quant is None:
        raise ValueError(f"{name}.weight is float8_e4m3fn but config.json has no quantization_config")
    scale = ckpt.get(f"{name}.{quant.scale_name}").float()
    return FP8Weight(weight, _scale_layout(scale, tuple(weight.shape), quant, name))


def _scale_layout(scale: torch.Tensor, shape: tuple[int, int], quant: CheckpointQuantization,
                  name: str) -> torch.Tensor:
    n, k = shape
    blocks = (-(-n // fp8.WEIGHT_BLOCK), -(-k // fp8.WEIGHT_BLOCK))
    if "tensor" in quant.layouts and scale.numel() == 1:
        return scale.reshape(1).expand(n).contiguous()  # (N,)
    if "channel" in quant.layouts and tuple(scale.shape) in ((n, 1), (n,)):
        return scale.reshape(n).contiguous()  # (N,)
    if "block" in quant.layouts and tuple(scale.shape) == blocks:
        return scale.contiguous()  # (ceil(N/128), ceil(K/128))
    raise ValueError(f"{name}.{quant.scale_name} has shape {tuple(scale.shape)}, which no layout of "
                     f"{quant.scheme} gives a ({n}, {k}) weight")


def check_kv_cache_scheme(quant: CheckpointQuantization | None) -> None:
    """A checkpoint's KV-cache scheme, if it names one, must be what the FP8 KV cache stores: ValueError if not."""
    scheme = quant.kv_cache_scheme if quant is not None else None
    if scheme and (scheme.get("num_bits") != 8 or scheme.get("type") != "float"
                   or scheme.get("strategy", "tensor") != "tensor"):
        raise ValueError(f"kv_cache_scheme {{num_bits {scheme.get('num_bits')}, type {scheme.get('type')!r}, "
                         f"strategy {scheme.get('strategy')!r}}} is unsupported; the FP8 KV cache takes 8-bit "
                         "float K and V with one scale each per layer (strategy tensor)")


def read_kv_scales(ckpt, attn: str) -> tuple[float, float] | None:
    """The (k_scale, v_scale) a layer's checkpoint holds (attn: "layers.<i>.self_attn."), None when it holds none.

    A cached value times its scale is the real value."""
    for k_name, v_name in _KV_SCALE_NAMES:
        if ckpt.has(attn + k_name) or ckpt.has(attn + v_name):
            k, v = attn + k_name, attn + v_name
            return _one_scale(ckpt.get(k), k), _one_scale(ckpt.get(v), v)
    return None


def _one_scale(t: torch.Tensor, name: str) -> float:
    if t.numel() != 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; the FP8 KV cache takes one scale per layer for K "
                         "and one for V")
    value = float(t.float().reshape(()))
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"{name} is {value}; a KV-cache scale must be positive and finite")
    return value
