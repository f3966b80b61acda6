"""transformers on the benchmark's prompts: plain `generate` on the CPU, continuous batching on CUDA."""
from __future__ import annotations

import dataclasses
import time

import torch

from backend.models import resolve_model_path


def _hf_model(model_name: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(model_name)
    config = AutoConfig.from_pretrained(path)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    attn = "paged|sdpa" if device.startswith("cuda") else "sdpa"
    with torch.device(device):  # random weights drawn on the device: same shape as ours, no checkpoint
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def run_transformers(wl, n: int, prompts: list[list[int]], device: str) -> list[dict]:
    model = _hf_model(wl.model, device)
    try:
        if device.startswith("cuda"):
            return [_continuous_batching(model, prompts, wl.new_tokens, use_async) for use_async in (False, True)]
        return [_plain_generate(model, prompts, wl.new_tokens)]
    finally:
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _plain_generate(model, prompts, new_tokens) -> dict:
    """One left-padded batch through `generate`, greedy, EOS ignored."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    return dict(mode="generate", wall_s=round(wall, 3), tok_per_s=round(tokens / wall, 1), output_tokens=tokens)


def _continuous_batching(model, prompts, new_tokens, use_async: bool) -> dict:
    """`generate_batch` with paged|sdpa attention and CUDA graphs, async double-buffering on or off."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    wanted = dict(use_cuda_graph=True, use_async_batching=use_async, auto_switch_to_flash=False,
                  max_requests_per_batch=len(prompts))
    cb = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in known})
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        results = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return dict(mode="cb-async" if use_async else "cb-sync", wall_s=round(wall, 3),
                tok_per_s=round(tokens / wall, 1), output_tokens=tokens,
                peak_mem_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2))
