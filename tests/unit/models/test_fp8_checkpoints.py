"""Pre-quantized FP8 checkpoints (each format written here from a tiny model) and quantization=fp8 on load: the
engine's greedy tokens equal those of the same model holding the dequantized weights; unsupported schemes fail at
load naming the scheme; an FP8 KV cache gets the checkpoint's k/v scales."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from backend import Engine, EngineConfig, SamplingParams
from backend.models import load_model
from backend.ops import fp8
from tests.tiny_models import EOS, VOCAB, build_tiny, random_prompts, word_tokenizer

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FLOAT8 = dict(num_bits=8, type="float", symmetric=True, dynamic=False)
_DYNAMIC_TOKENS = dict(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token")


def _compressed_tensors(weights: dict, inputs: dict | None, fmt: str = "float-quantized", **extra) -> dict:
    group = dict(targets=["Linear"], weights={**_FLOAT8, **weights}, input_activations=inputs)
    return dict(quant_method="compressed-tensors", format=fmt, quantization_status="compressed",
                config_groups={"group_0": group}, ignore=["lm_head"], **extra)


# format -> (quantization_config, scale layout, scale tensor name, KV-scale names or None, quantize the LM head)
FORMATS = {
    "ct-channel": (_compressed_tensors(dict(strategy="channel"), _DYNAMIC_TOKENS,
                                       kv_cache_scheme=dict(_FLOAT8, strategy="tensor")),
                   "channel", "weight_scale", ("self_attn.k_scale", "self_attn.v_scale"), False),
    "ct-tensor-static": (_compressed_tensors(dict(strategy="tensor"), dict(_FLOAT8, strategy="tensor"),
                                             fmt="naive-quantized"),
                         "tensor", "weight_scale", None, False),
    "ct-block": (_compressed_tensors(dict(strategy="block", block_structure=[128, 128]),
                                     dict(_DYNAMIC_TOKENS, strategy="group", group_size=128)),
                 "block", "weight_scale", None, False),
    "fp8-block": (dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]),
                  "block", "weight_scale_inv", None, False),
    "fp8-tensor-static": (dict(quant_method="fp8", activation_scheme="static"), "tensor", "weight_scale",
                          ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"), True),
}
# the tiny model each format is written from: blocks need q, k, v, gate and up rows in whole 128-row blocks
FAMILY = {"ct-channel": "qwen2", "ct-tensor-static": "llama", "ct-block": "llama-256", "fp8-block": "llama-256",
          "fp8-tensor-static": "qwen3"}


def build_model(family: str, root: str) -> str:
    if family != "llama-256":
        return build_tiny(family, root)
    path = os.path.join(root, "tiny-llama-256")
    if not os.path.isdir(path):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             eos_token_id=EOS, bos_token_id=1, tie_word_embeddings=False)  # q 256, k 128, v 128 rows
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
        word_tokenizer().save_pretrained(path)
    return path


def quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (N, K) -> (e4m3 weight, the scale as the file stores it, the scale a dequantized copy uses)."""
    if layout == "channel":
        q, scale = fp8.quantize_per_channel(w)
        stored = scale[:, None].to(torch.bfloat16)  # (N, 1) in the model's dtype, as compressed-tensors keeps it
        return q, stored, stored.float().reshape(-1)
    if layout == "tensor":
        scale = (w.abs().amax() / fp8.FP8_MAX).float()  # one scale for the whole tensor
        q = (w.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
        return q, scale.reshape(1), scale.expand(w.shape[0])
    q, scale = fp8.quantize_per_block(w)
    return q, scale, scale


def write_pair(src: str, dst: str, fmt: str) -> tuple[str, str]:
    """src's model as an FP8 checkpoint of format fmt under dst/fp8, and the same model holding the dequantized
    weights (float32) under dst/ref."""
    qconfig, layout, scale_name, kv_names, quantize_head = FORMATS[fmt]
    fp8_dir, ref_dir = os.path.join(dst, "fp8"), os.path.join(dst, "ref")
    if os.path.isdir(fp8_dir):
        return fp8_dir, ref_dir
    state = load_file(os.path.join(src, "model.safetensors"))
    config = json.loads(open(os.path.join(src, "config.json")).read())
    quantized, ref = {}, {}
    for name, t in state.items():
        linear = name.rsplit(".", 2)[-2]
        if name.endswith(".weight") and (linear in LINEARS or quantize_head and linear == "lm_head"):
            q, stored, used = quantize(t, layout)
            base = name[: -len(".weight")]
            quantized[name], quantized[f"{base}.{scale_name}"] = q, stored
            if layout == "tensor":  # a static activation scale, which the loader leaves unused
                quantized[f"{base}.input_scale"] = torch.tensor([0.05])
            ref[name] = fp8.dequantize(q, used, torch.float32)
        else:
            quantized[name] = ref[name] = t
    if kv_names:  # per-layer KV-cache scales, each layer its own, bf16 as checkpoints store them
        for i in range(config["num_hidden_layers"]):
            for j, kv in enumerate(kv_names):
                quantized[f"model.layers.{i}.{kv}"] = torch.tensor(0.0123 * (i + 1) + 0.5 * j, dtype=torch.bfloat16)
    fp8_config = {**config, "quantization_config": qconfig}
    for folder, tensors, cfg in ((fp8_dir, quantized, fp8_config), (ref_dir, ref, config)):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
    return fp8_dir, ref_dir


def write_quantized_on_load_reference(src: str, dst: str) -> str:
    """src's model with every linear weight of its layers replaced by dequantize(quantize_per_channel(W))."""
    if not os.path.isdir(dst):
        state = load_file(os.path.join(src, "model.safetensors"))
        for name, t in state.items():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
                state[name] = fp8.dequantize(*fp8.quantize_per_channel(t), torch.float32)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(state, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fp8ckpt"))


def greedy_tokens(path: str, **settings) -> list[list[int]]:
    engine = Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=24,
                                 max_num_seqs=8, async_pipeline=False, **settings))
    try:
        prompts = random_prompts([5, 17, 30])
        outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        return [o.token_ids for o in outs]
    finally:
        engine.shutdown()


def assert_dequantized_equal(model, ref) -> None:
    """Each FP8 linear of model, dequantized to float32, is ref's weight bit for bit; the rest is ref's own."""
    for a, b in zip(model.layers, ref.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            w, scale = getattr(a, f"{name}_weight"), getattr(a, f"{name}_scale")
            assert w.dtype == fp8.FP8_DTYPE and scale is not None and scale.dtype == torch.float32
            assert torch.equal(fp8.dequantize(w, scale, torch.float32), getattr(b, f"{name}_weight"))
        assert torch.equal(a.input_norm, b.input_norm)
    assert torch.equal(model.embed_tokens, ref.embed_tokens) and torch.equal(model.lm_head, ref.lm_head)
    assert model.lm_head.dtype == torch.float32


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_equals_its_dequantized_model(root, fmt):
    """Fused q/k/v and gate/up keep the parts' scales (per-tensor -> per-channel, block rows concatenated), so the
    model is exactly the dequantized one: same weights, same greedy tokens."""
    fp8_dir, ref_dir = write_pair(build_model(FAMILY[fmt], root), os.path.join(root, fmt), fmt)
    model, ref = load_model(fp8_dir), load_model(ref_dir)
    assert_dequantized_equal(model, ref)
    want_dims = 2 if FORMATS[fmt][1] == "block" else 1
    assert all(layer.qkv_scale.dim() == want_dims and layer.kv_scale is None for layer in model.layers)
    if FORMATS[fmt][1] == "tensor":  # q, k and v each had one scale: the fused rows take their part's
        layer, sizes = model.layers[0], model.qkv_sizes
        assert [len(set(s.tolist())) for s in layer.qkv_scale.split(sizes)] == [1, 1, 1]
    assert greedy_tokens(fp8_dir) == greedy_tokens(ref_dir)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quantization_fp8_on_load_equals_the_quantize_dequantized_model(root, family):
    src = build_tiny(family, root)
    ref_dir = write_quantized_on_load_reference(src, os.path.join(root, f"qdq-{family}"))
    model = load_model(src, quantization="fp8")
    assert_dequantized_equal(model, load_model(ref_dir))
    assert all(layer.qkv_scale.shape == (layer.qkv_weight.shape[0],) for layer in model.layers)
    assert greedy_tokens(src, quantization="fp8") == greedy_tokens(ref_dir)


def test_quantization_fp8_keeps_an_fp8_checkpoint_as_it_is(root):
    """Its FP8 weights as stored, and a layer its ignore list leaves wide stays wide."""
    fp8_dir, ref_dir = write_pair(build_model("llama", root), os.path.join(root, "ct-tensor-static"),
                                  "ct-tensor-static")
    path = os.path.join(root, "ct-tensor-static-ignore")
    shutil.copytree(fp8_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(os.path.join(fp8_dir, "model.safetensors"))
    wide = "model.layers.1.mlp.down_proj"
    state = {k: v for k, v in state.items() if not k.startswith(wide + ".")}
    state[wide + ".weight"] = load_file(os.path.join(ref_dir, "model.safetensors"))[wide + ".weight"]
    save_file(state, os.path.join(path, "model.safetensors"))
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config["quantization_config"]["ignore"].append(wide)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    a, b = load_model(path), load_model(path, quantization="fp8")
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.qkv_weight.view(torch.uint8), y.qkv_weight.view(torch.uint8))
        assert torch.equal(x.qkv_scale, y.qkv_scale)
    assert b.layers[1].down_scale is None and b.layers[1].down_weight.dtype == torch.float32
    assert torch.equal(b.layers[1].down_weight, load_model(ref_dir).layers[1].down_weight)


@pytest.mark.parametrize("fmt", ["ct-channel", "fp8-tensor-static"])
def test_fp8_kv_cache_takes_the_checkpoints_scales(root, fmt):
    """k_scale / v_scale (compressed-tensors' kv_cache_scheme) or k_proj / v_proj output_scale: each layer's
    kv_scale is [k_scale, v_scale] from the file; without kv_cache_dtype=fp8 there is none."""
    fp8_dir, _ = write_pair(build_model(FAMILY[fmt], root), os.path.join(root, fmt), fmt)
    state = load_file(os.path.join(fp8_dir, "model.safetensors"))
    k_name, v_name = FORMATS[fmt][3]
    model = load_model(fp8_dir, kv_cache_dtype="fp8")
    for i, layer in enumerate(model.layers):
        want = torch.tensor([state[f"model.layers.{i}.{k_name}"].item(), state[f"model.layers.{i}.{v_name}"].item()])
        assert layer.kv_scale.dtype == torch.float32 and torch.equal(layer.kv_scale, want)
    assert model.layers[0].kv_scale[0] != model.layers[1].kv_scale[0]
    assert all(layer.kv_scale is None for layer in load_model(fp8_dir).layers)


def test_fp8_kv_cache_without_checkpoint_scales_uses_one(root):
    model = load_model(build_tiny("llama", root), kv_cache_dtype="fp8")
    assert all(torch.equal(layer.kv_scale, torch.tensor([1.0, 1.0])) for layer in model.layers)


def test_block_checkpoint_with_parts_off_the_block_grid_is_requantized(root, caplog):
    """A tiny model's k and v (32 rows each) cannot keep their blocks in a fused qkv: it is requantized per block
    (logged), within one e4m3 rounding of the checkpoint; o and down, unfused, stay exact."""
    fp8_dir, ref_dir = write_pair(build_tiny("llama", root), os.path.join(root, "fp8-block-small"), "fp8-block")
    with caplog.at_level(logging.WARNING, logger="backend.models.loader"):
        model = load_model(fp8_dir)
    assert "requantized per 128 x 128 block" in caplog.text and "q_proj+k_proj+v_proj" in caplog.text
    ref = load_model(ref_dir)
    for a, b in zip(model.layers, ref.layers):
        assert torch.equal(fp8.dequantize(a.o_weight, a.o_scale, torch.float32), b.o_weight)
        assert torch.equal(fp8.dequantize(a.down_weight, a.down_scale, torch.float32), b.down_weight)
        got = fp8.dequantize(a.qkv_weight, a.qkv_scale, torch.float32)
        step = torch.maximum(b.qkv_weight.abs() * 2.0 ** -4, fp8.expand_scale(a.qkv_scale, got.shape) * 2.0 ** -10)
        assert torch.all((got - b.qkv_weight).abs() <= step * (1 + 1e-6))


def _config_with(root: str, name: str, quantization_config: dict) -> str:
    """A checkpoint folder holding only a config.json with this quantization_config (the check comes first)."""
    path = os.path.join(root, "schemes", name)
    os.makedirs(path, exist_ok=True)
    config = json.loads(open(os.path.join(build_tiny("llama", root), "config.json")).read())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f)
    return path


UNSUPPORTED = {
    "awq": (dict(quant_method="awq", bits=4, group_size=128, version="gemm"), "'awq'"),
    "gptq": (dict(quant_method="gptq", bits=4, group_size=128), "'gptq'"),
    "bitsandbytes": (dict(quant_method="bitsandbytes", load_in_4bit=True), "'bitsandbytes'"),
    "ct-int8": (_compressed_tensors(dict(strategy="channel", type="int"), None, fmt="int-quantized"),
                "format 'int-quantized'"),
    "ct-int8-naive": (_compressed_tensors(dict(strategy="channel", type="int"), None, fmt="naive-quantized"),
                      "type 'int'"),
    "ct-fp4": (_compressed_tensors(dict(strategy="channel", num_bits=4), None), "num_bits 4"),
    "ct-group": (_compressed_tensors(dict(strategy="group", group_size=128), None), "strategy 'group'"),
    "ct-block-64": (_compressed_tensors(dict(strategy="block", block_structure=[64, 64]), None),
                    r"block_structure \[64, 64\]"),
    "ct-int8-activations": (_compressed_tensors(dict(strategy="channel"), dict(num_bits=8, type="int")),
                            "input_activations"),
    "fp8-block-64": (dict(quant_method="fp8", weight_block_size=[64, 64]), r"weight_block_size \[64, 64\]"),
    "fp8-e5m2": (dict(quant_method="fp8", fmt="e5m2"), "'e5m2'"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_quantization_fails_at_load_naming_the_scheme(root, name):
    qconfig, scheme = UNSUPPORTED[name]
    with pytest.raises(ValueError, match=scheme) as err:
        load_model(_config_with(root, name, qconfig))
    assert "supported: compressed-tensors" in str(err.value)


def test_unsupported_kv_cache_scheme_fails_only_with_an_fp8_cache(root):
    qconfig = _compressed_tensors(dict(strategy="channel"), None,
                                  kv_cache_scheme=dict(num_bits=8, type="int", strategy="tensor"))
    fp8_dir, _ = write_pair(build_model("qwen2", root), os.path.join(root, "ct-channel"), "ct-channel")
    path = os.path.join(root, "ct-channel-int8-kv")
    shutil.copytree(fp8_dir, path, dirs_exist_ok=True)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": qconfig}, f)
    with pytest.raises(ValueError, match="kv_cache_scheme .*type 'int'"):
        load_model(path, kv_cache_dtype="fp8")
    assert load_model(path).layers[0].kv_scale is None


def test_inconsistent_fp8_checkpoints_fail_clearly(root):
    """FP8 weights without a quantization_config; a fused weight with only some parts in FP8; per-head KV scales."""
    fp8_dir, _ = write_pair(build_model("qwen2", root), os.path.join(root, "ct-channel"), "ct-channel")
    state = load_file(os.path.join(fp8_dir, "model.safetensors"))
    config = json.loads(open(os.path.join(fp8_dir, "config.json")).read())

    def variant(name: str, tensors: dict, cfg: dict) -> str:
        path = os.path.join(root, "broken", name)
        shutil.copytree(fp8_dir, path, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        save_file(tensors, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        return path

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with pytest.raises(ValueError, match="no quantization_config"):
        load_model(variant("no-config", state, plain))
    k_wide = {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)}
    with pytest.raises(ValueError, match="only some of .*q_proj.*k_proj.*v_proj"):
        load_model(variant("mixed", k_wide, config))
    per_head = {**state, "model.layers.0.self_attn.k_scale": torch.ones(2)}
    with pytest.raises(ValueError, match="k_scale has shape \\(2,\\)"):
        load_model(variant("per-head-kv", per_head, config), kv_cache_dtype="fp8")


def test_bad_loader_settings_fail():
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model("/nonexistent", quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        load_model("/nonexistent", kv_cache_dtype="fp16")
