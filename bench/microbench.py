"""Microbenchmarks of one decode step's memory-bound parts on CUDA: paged decode attention and the weight pass.

`python -m bench.microbench [--sweep]` prints a table, then one JSON line. Every figure is bytes that
must cross device memory (KV read once / weights read once) over the time of a CUDA-graph replay.
`--linear --fp8 [--fp8-scales block] [--gated] [--park]` times the GEMMs with FP8 weights (sweep_linear_fp8).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from backend.ops.triton import buffers
from backend.ops.tuning import LinearConfig

__all__ = ["bench_decode_attention", "bench_prefill_attention", "bench_weight_pass", "sweep_decode", "sweep_prefill",
           "sweep_linear", "sweep_linear_fp8"]


_DEV = "cuda"


def _require_cuda():
    if _DEV == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the microbenchmarks need a CUDA device")


def _time_graph(fn, replays: int = 20, repeats: int = 7, chain: int = 1) -> float:
    """Median milliseconds of one call of fn, captured in a CUDA graph (`chain` calls back to back, as the
    kernels of a decode step run) and replayed `replays` times a sample."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile, autotune and allocate outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: split-K GEMM counters are per stream
        for _ in range(chain):
            fn()
    for _ in range(3):
        graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays / chain)
    del graph
    return statistics.median(samples)


class _DecodeSetup:
    """A decode batch over a random paged cache: every sequence `context` long, shuffled block ids."""

    def __init__(self, batch, context, num_heads, num_kv_heads, head_dim, block_size, dtype):
        from backend.ops.attention_metadata import AttentionMetadata

        dev = _DEV
        blocks_per_seq = -(-context // block_size)
        num_blocks = 1 + batch * blocks_per_seq
        self.cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
        self.cache.normal_()
        ids = torch.randperm(num_blocks - 1, device=dev)[: batch * blocks_per_seq] + 1
        bt = ids.view(batch, blocks_per_seq).to(torch.int32)
        last = context - 1
        slots = bt[:, last // block_size].long() * block_size + last % block_size
        self.meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
            block_tables=bt,
            max_query_len=1,
            max_seq_len=context,
        )
        self.q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=dev)
        self.k = torch.randn(batch, num_kv_heads, head_dim, dtype=dtype, device=dev)
        self.v = torch.randn(batch, num_kv_heads, head_dim, dtype=dtype, device=dev)
        self.scale = head_dim ** -0.5
        self.kv_bytes = 2 * batch * context * num_kv_heads * head_dim * self.cache.element_size()


def bench_decode_attention(batch=32, context=4096, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                           dtype=torch.bfloat16, **launch) -> dict:
    """One layer's paged decode attention (KV write + split-K attention + reduce); TB/s = KV bytes / time."""
    _require_cuda()
    from backend.ops.triton import attention as ta

    s = _DecodeSetup(batch, context, num_heads, num_kv_heads, head_dim, block_size, dtype)
    if launch:
        def step():
            ta.write_kv_cache(s.k, s.v, s.cache, s.meta.slot_mapping)
            return ta.decode_attention(s.q, s.cache, s.meta, s.scale, **launch)
    else:
        def step():
            return ta.paged_attention(s.q, s.k, s.v, s.cache, s.meta, s.scale)
    ms = _time_graph(step)
    splits = launch.get("num_splits") or ta.choose_num_splits(batch, num_kv_heads, context,
                                                              buffers.sm_count(s.q.device))
    return dict(ms=ms, tb_per_s=s.kv_bytes / ms / 1e9, num_splits=splits)


def sweep_decode(batch=32, context=4096, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                 splits=(1, 2, 3, 4, 6, 8, 16)) -> list:
    """Decode attention over split counts (default tile): rows for KERNELS.md."""
    from backend.ops.triton import attention as ta

    auto = ta.choose_num_splits(batch, num_kv_heads, context, buffers.sm_count(torch.device(_DEV)))
    rows = []
    for n in sorted(set(splits) | {auto}):
        shape = dict(batch=batch, context=context, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size)
        rows.append(dict(shape, auto=n == auto, **_guarded(bench_decode_attention, **shape, num_splits=n)))
    return rows


def sweep_prefill() -> list:
    """Prefill attention (one 2K prompt) over tile shapes, warps and stages."""
    rows = []
    for bm, bn, w, st in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                          (128, 128, 8, 2), (64, 128, 4, 2)):
        cfg = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        rows.append(dict(cfg, **_guarded(bench_prefill_attention, **cfg)))
    return rows


def _guarded(fn, **kw) -> dict:
    try:
        return fn(**kw)
    except Exception as exc:  # an unlucky config (shared memory, registers) must not end the sweep
        return dict(ms=float("nan"), error=f"{type(exc).__name__}: {exc}"[:160])


def bench_prefill_attention(num_tokens=2048, num_seqs=1, num_heads=32, num_kv_heads=8, head_dim=128,
                            block_size=16, dtype=torch.bfloat16, **launch) -> dict:
    """Causal prefill of `num_seqs` prompts of num_tokens/num_seqs tokens each; TFLOP/s of the causal half."""
    _require_cuda()
    from backend.ops.attention_metadata import AttentionMetadata
    from backend.ops.triton import attention as ta

    dev = _DEV
    n = num_tokens // num_seqs
    bps = -(-n // block_size)
    num_blocks = 1 + num_seqs * bps
    cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev).normal_()
    bt = (torch.randperm(num_blocks - 1, device=dev) + 1).view(num_seqs, bps).to(torch.int32)
    p = torch.arange(n, device=dev)
    slots = (bt[:, p // block_size].long() * block_size + p % block_size).reshape(-1)
    meta = AttentionMetadata(slots, torch.arange(0, num_seqs * n + 1, n, dtype=torch.int32, device=dev),
                             torch.full((num_seqs,), n, dtype=torch.int32, device=dev), bt, n, n)
    q = torch.randn(num_seqs * n, num_heads, head_dim, dtype=dtype, device=dev)
    k = torch.randn(num_seqs * n, num_kv_heads, head_dim, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    if launch:
        def step():
            ta.write_kv_cache(k, v, cache, slots)
            return ta.prefill_attention(q, cache, meta, head_dim ** -0.5, **launch)
    else:
        def step():
            return ta.paged_attention(q, k, v, cache, meta, head_dim ** -0.5)
    ms = _time_graph(step, replays=10)
    flops = num_seqs * 4 * (n * (n + 1) / 2) * num_heads * head_dim
    return dict(ms=ms, tflop_per_s=flops / ms / 1e9)


class _PagedBatch:
    """One step's sequences over a random paged cache: each (cached tokens, query tokens), shuffled block ids."""

    def __init__(self, seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                 cache=None):
        from backend.ops.attention_metadata import AttentionMetadata

        dev = _DEV
        lens = [c + n for c, n in seqs]
        bps = max(-(-n // block_size) for n in lens)
        num_blocks = 1 + len(seqs) * bps
        if cache is None:
            cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev).normal_()
        self.cache = cache
        ids = (torch.randperm(self.cache.shape[1] - 1, device=dev)[: len(seqs) * bps] + 1).view(len(seqs), bps)
        self.block_tables = ids.to(torch.int32)
        qsl = [0]
        for _, n in seqs:
            qsl.append(qsl[-1] + n)
        t = qsl[-1]
        self.meta = AttentionMetadata(
            slot_mapping=torch.zeros(t, dtype=torch.int64, device=dev),  # unused: the cache is written beforehand
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=self.block_tables,
            max_query_len=max(n for _, n in seqs),
            max_seq_len=max(lens),
        )
        self.q = torch.randn(t, num_heads, head_dim, dtype=dtype, device=dev)
        self.scale = head_dim ** -0.5
        self.kv_bytes = 2 * sum(lens) * num_kv_heads * head_dim * self.cache.element_size()
        self.flops = sum(4 * n * (c + (n + 1) / 2) * num_heads * head_dim for c, n in seqs)


MIXED_STEPS = {  # name: (decode rows, prompt lengths); decode contexts drawn like bench.traffic's mix
    "join_1x300": (255, [300]),
    "join_2x220": (254, [220, 220]),
    "join_1x2048": (255, [2048]),
    "start_27x300": (0, [300] * 27),
    "decode_only": (256, []),
}
PREFILL_CONFIGS = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (16, 64, 4, 3),
                   (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2))


def _mix_contexts(n: int, seed: int = 0) -> list[int]:
    """Context lengths of n running requests of the realistic mix, each part-way through its output. A request
    stays in the running set as long as its output takes, so requests are drawn weighted by output length."""
    import random

    from bench.traffic import _lognormal

    if n == 0:
        return []
    rng = random.Random(seed)
    pool = [(_lognormal(rng, 220, 0.8, 4, 2048), _lognormal(rng, 160, 0.8, 1, 1024)) for _ in range(20 * n)]
    picks = rng.choices(pool, weights=[out for _, out in pool], k=n)
    return [prompt + int(rng.random() * out) for prompt, out in picks]


def bench_mixed_attention(name: str) -> list:
    """One layer's attention of a mixed step (decode rows of the realistic mix beside whole prompts): the prefill
    kernel over every row, then the decode kernel over the decode rows plus the prefill kernel over the prompts,
    then the prefill kernel's launch shapes. TB/s = K+V bytes of all contexts / time."""
    _require_cuda()
    from backend.ops.triton import attention as ta

    decodes, prompts = MIXED_STEPS[name]
    ctx = _mix_contexts(decodes)
    seqs = [(c - 1, 1) for c in ctx] + [(0, n) for n in prompts]
    whole = _PagedBatch(seqs)
    rows = []

    def record(label, fn, **extra):
        try:
            ms = _time_graph(fn, replays=10, repeats=5)
        except Exception as exc:  # an unlucky config (shared memory, registers) must not end the sweep
            rows.append(dict(step=name, path=label, error=f"{type(exc).__name__}: {exc}"[:160], **extra))
            return
        rows.append(dict(step=name, path=label, ms=ms, tb_per_s=whole.kv_bytes / ms / 1e9,
                         tflop_per_s=whole.flops / ms / 1e9, **extra))

    if decodes and prompts:
        dec = _PagedBatch(seqs[:decodes], cache=whole.cache)
        pre = _PagedBatch(seqs[decodes:], cache=whole.cache)
        q_dec, q_pre = whole.q[:decodes], whole.q[decodes:]

        def split():
            ta.decode_attention(q_dec, dec.cache, dec.meta, dec.scale)
            return ta.prefill_attention(q_pre, pre.cache, pre.meta, pre.scale)
        record("decode kernel + prefill kernel", split)
    if not prompts:
        record("decode kernel", lambda: ta.decode_attention(whole.q, whole.cache, whole.meta, whole.scale))
    for bm, bn, w, st in PREFILL_CONFIGS:
        cfg = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        record("prefill kernel", lambda cfg=cfg: ta.prefill_attention(whole.q, whole.cache, whole.meta, whole.scale,
                                                                      **cfg), **cfg)
    return rows


def bench_weight_pass(hidden=4096, intermediate=14336, layers=32, vocab=128256, heads=32, kv_heads=8, batch=32,
                      with_layers=False, linear=F.linear) -> dict:
    """One decode step's fused GEMMs (qkv, o, gate_up, down per layer, then lm_head), random bf16 weights.

    with_layers adds the fused Triton norm and activation kernels between them (attention itself is left out);
    linear is F.linear (cuBLAS) or triton_linear.linear."""
    _require_cuda()
    dev, dt = _DEV, torch.bfloat16
    head_dim = hidden // heads
    qkv_out = (heads + 2 * kv_heads) * head_dim

    def weight(out_f, in_f):  # std 1/sqrt(in) keeps activations bounded through 129 GEMMs
        return torch.empty(out_f, in_f, dtype=dt, device=dev).normal_(0.0, in_f ** -0.5)

    ws = [(weight(qkv_out, hidden), weight(hidden, heads * head_dim), weight(2 * intermediate, hidden),
           weight(hidden, intermediate)) for _ in range(layers)]
    lm_head = weight(vocab, hidden)
    norm_w = torch.ones(hidden, dtype=dt, device=dev)
    x = torch.randn(batch, hidden, dtype=dt, device=dev)
    nbytes = sum(w.numel() * w.element_size() for layer in ws for w in layer) + lm_head.numel() * 2
    if with_layers:
        from backend.ops.triton import layers as tly

    def step():
        h = x
        residual = x
        for wqkv, wo, wgu, wd in ws:
            qkv = linear(h, wqkv)
            attn = qkv[:, : heads * head_dim]  # stands in for attention's output (same shape)
            h = linear(attn, wo)
            if with_layers:
                h, residual = tly.add_rms_norm(h, residual, norm_w, 1e-5)
                act = tly.silu_and_mul(linear(h, wgu))
            else:
                act = linear(h, wgu)[:, :intermediate]
            h = linear(act, wd)
        return linear(h, lm_head)

    ms = _time_graph(step, replays=10, repeats=5)
    return dict(ms=ms, tb_per_s=nbytes / ms / 1e9, gbytes=nbytes / 1e9)


LINEAR_SHAPES = {  # (N, K) of the decode GEMMs: Llama-3-8B and Llama-3.2-1B
    "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
    "8b_lm_head": (128256, 4096), "1b_qkv": (3072, 2048), "1b_o": (2048, 2048), "1b_gate_up": (16384, 2048),
    "1b_down": (2048, 8192), "1b_lm_head": (128256, 2048),
}
LINEAR_SWEEP = ((32, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3),
                (64, 256, 8, 4), (128, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3), (128, 64, 4, 4),
                (16, 256, 4, 4),
                # split-K (fifth field): for narrow W with a long K, and for 64 rows, where each program's x
                # tile costs as much as its W tile unless K is cut
                (64, 128, 4, 4, 2), (64, 128, 4, 6, 2), (64, 128, 4, 4, 4), (64, 256, 4, 3, 2), (32, 128, 4, 4, 4),
                (32, 256, 4, 3, 4), (16, 256, 4, 4, 4), (64, 64, 4, 4, 4), (64, 64, 4, 4, 8), (128, 64, 4, 4, 4),
                (128, 64, 4, 4, 8), (128, 128, 4, 4, 2), (128, 128, 4, 4, 4), (128, 128, 8, 4, 4),
                (256, 64, 8, 4, 4), (256, 64, 8, 4, 8))


def sweep_linear(rows_list=(1, 32, 64), shapes=None, configs=LINEAR_SWEEP, chain: int = 1, pdl: bool = False,
                 park: bool = False, gated: bool = False) -> list:
    """Each decode GEMM shape: cuBLAS, the kernel's own choice, and every config in `configs`; TB/s of W.

    chain > 1 times that many calls back to back in one graph; pdl launches the kernel as a programmatic
    dependent (each call's start overlaps the previous call's end, as between the kernels of a step); park
    leaves split-K partials unsummed, as when the next kernel (add_rms_norm) adds them; gated times W as a
    [gate; up] weight with SiLU-and-mul: the fused kernel (linear_silu_and_mul) for every config, against cuBLAS
    and the table's GEMM ("unfused") each followed by the SiLU-and-mul kernel."""
    from backend.ops.triton import layers as tly
    from backend.ops.triton import linear as tlin

    out = []
    for name, (n, k) in (shapes or LINEAR_SHAPES).items():
        w = torch.empty(n, k, dtype=torch.bfloat16, device=_DEV).normal_(0.0, k ** -0.5)
        # a chain reads a different copy of W each call: the same W again would come from L2
        copies = itertools.cycle([w] + [w.clone() for _ in range(chain - 1)])
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=_DEV)

            def kernel(cfg=None):
                if gated:
                    return tlin.linear_silu_and_mul(x, next(copies), config=cfg, pdl=pdl)
                return tlin.linear(x, next(copies), config=cfg, pdl=pdl, park=park)

            def cublas():
                y = F.linear(x, next(copies))
                return tly.silu_and_mul(y, pdl=pdl) if gated else y

            row = dict(shape=name, rows=rows, auto=tlin.choose_config(n, k, buffers.sm_count(w.device)))
            row["cublas"] = w.numel() * 2 / _time_graph(cublas, chain=chain) / 1e9
            listed = tlin.H200_CONFIGS.get((n, k, tlin._block_m(rows)))
            if gated and listed is not None:
                def unfused():
                    return tly.silu_and_mul(tlin.linear(x, next(copies), config=listed, pdl=pdl), pdl=pdl)

                row["unfused"] = w.numel() * 2 / _time_graph(unfused, chain=chain) / 1e9
            row["triton_auto"] = w.numel() * 2 / _time_graph(kernel, chain=chain) / 1e9
            for cfg in configs:
                c = tlin.LinearConfig(*cfg)
                r = _guarded(lambda **_: dict(ms=_time_graph(lambda: kernel(c), chain=chain)))
                row["x".join(map(str, cfg))] = 0.0 if r["ms"] != r["ms"] else w.numel() * 2 / r["ms"] / 1e9
            best = max((key for key in row if key not in ("shape", "rows", "auto")), key=lambda key: row[key])
            row["best"] = best
            out.append(row)
            unfused = f" unfused={row['unfused']:.3f}" if "unfused" in row else ""
            print(f"  {name:11s} rows={rows:3d} cublas={row['cublas']:.3f}{unfused} auto={row['triton_auto']:.3f} "
                  f"({row['auto'].block_n}x{row['auto'].block_k}) best={best} {row[best]:.3f} TB/s", flush=True)
            row["auto"] = str(row["auto"])
        del w, copies
    return out


FP8_LINEAR_SHAPES = {  # (N, K) of the GEMMs with FP8 weights: Llama-3-8B and Llama-3-70B
    "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
    "70b_qkv": (10240, 8192), "70b_o": (8192, 8192), "70b_gate_up": (57344, 8192), "70b_down": (8192, 28672),
}
# the FP8 decode kernel's launch shapes (block_n, block_k, warps, stages[, split_k]); block scales take those with
# block_k ≤ 128 only
FP8_LINEAR_SWEEP = ((16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 4), (64, 256, 4, 6), (128, 256, 8, 4),
                    (32, 128, 4, 4), (64, 128, 4, 4), (64, 128, 4, 6), (128, 128, 4, 4), (64, 512, 4, 3),
                    (64, 256, 4, 4, 2), (64, 128, 4, 4, 2), (64, 128, 4, 4, 4), (32, 256, 4, 4, 4),
                    (128, 128, 4, 4, 4))
FP8_GEMM_SWEEP = ((64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (64, 256, 4, 3))
FP8_PREFILL_ROWS = (2048, 4096)


def sweep_linear_fp8(rows_list=(1, 16, 32, 64, 128, 256), shapes=None, configs=FP8_LINEAR_SWEEP,
                     scales: str = "channel", chain: int = 1, pdl: bool = False, park: bool = False,
                     gated: bool = False, prefill_rows=FP8_PREFILL_ROWS) -> list:
    """GEMMs with FP8 (e4m3) weights, per shape and row count: the milliseconds of every path that applies and the
    TB/s of the weight bytes it reads (2 a weight in bf16, 1 in e4m3), the fastest path by time as "best".

    Paths: bf16_cublas (F.linear, bf16 W); bf16_kernel (the bf16 decode kernel, ≤ 64 rows, the H200 table's
    config where listed); fp8_auto and fp8_<config> (the FP8 decode kernel widening W: fp8_linear's rule, then
    each of `configs`; up to fp8_linear.DECODE_ROW_LIMIT rows, past FP8_MAX_ROWS to see where it stops winning),
    fp8x8_auto and fp8x8_<config> (the same launch shapes multiplying FP8 by FP8, x's quantization included);
    scaled_mm (x quantized per row + torch._scaled_mm: per-channel scales, the "cublas" FP8 path at every row
    count) and scaled_mm_only (x quantized beforehand: the quantization's share is the difference); block_gemm and
    block_gemm_<config> (x quantized per 128-column group + the block-scaled GEMM: block scales); dequant_cublas
    (the torch reference: W dequantized to bf16, then F.linear). prefill_rows are timed with the GEMM paths only
    and report TFLOP/s as well. gated: W as [gate; up] with SiLU-and-mul (fused FP8 kernel against fp8_unfused,
    the FP8 GEMM then the SiLU-and-mul kernel, and every other path followed by that kernel); park: the FP8
    kernel's split-K partials are left for the next kernel."""
    from backend.ops import fp8
    from backend.ops.torch import layers as torch_layers
    from backend.ops.triton import fp8_linear as f8
    from backend.ops.triton import layers as tly
    from backend.ops.triton import linear as tlin

    block = scales == "block"
    quantize = fp8.quantize_per_block if block else fp8.quantize_per_channel
    kernel_configs = [c for c in configs if not block or c[1] <= 128]
    out = []
    for name, (n, k) in (shapes or FP8_LINEAR_SHAPES).items():
        w = torch.empty(n, k, dtype=torch.bfloat16, device=_DEV).normal_(0.0, k ** -0.5)
        q, s = quantize(w)
        # a chain reads a different copy of W each call: the same W again would come from L2
        bf16_w = itertools.cycle([w] + [w.clone() for _ in range(chain - 1)])
        fp8_w = itertools.cycle([(q, s)] + [(q.clone(), s.clone()) for _ in range(chain - 1)])
        for rows in tuple(rows_list) + tuple(prefill_rows):
            prefill = rows in prefill_rows
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=_DEV)

            def act(y):
                return tly.silu_and_mul(y, pdl=pdl) if gated else y

            paths = {"bf16_cublas": (lambda: act(F.linear(x, next(bf16_w))), 2)}
            if rows <= tlin.MAX_ROWS:
                listed = (tlin.H200_GATED_CONFIGS if gated else tlin.H200_CONFIGS).get((n, k, tlin._block_m(rows)))
                paths["bf16_kernel"] = ((lambda: tlin.linear_silu_and_mul(x, next(bf16_w), config=listed, pdl=pdl))
                                        if gated else (lambda: tlin.linear(x, next(bf16_w), config=listed, pdl=pdl)), 2)
            kernel_rows = f8.FP8_MAX_ROWS if gated else f8.DECODE_ROW_LIMIT
            if not prefill and rows <= kernel_rows:
                def kernel(cfg=None, quantize_x=False):
                    qq, ss = next(fp8_w)
                    if gated:
                        return f8.linear_silu_and_mul(x, qq, ss, config=cfg, pdl=pdl, quantize_x=quantize_x)
                    return f8.decode_linear(x, qq, ss, config=cfg, pdl=pdl, park=park, quantize_x=quantize_x)

                paths["fp8_auto"] = (kernel, 1)
                paths["fp8x8_auto"] = (lambda: kernel(quantize_x=True), 1)
                if gated:
                    paths["fp8_unfused"] = (lambda: act(f8.decode_linear(x, *next(fp8_w), pdl=pdl)), 1)
                for cfg in kernel_configs:
                    if gated and (len(cfg) > 4 or cfg[0] < 32):
                        continue  # the fused kernel takes no K split and at least 16 rows of each half
                    paths["fp8_" + "x".join(map(str, cfg))] = (lambda c=LinearConfig(*cfg): kernel(c), 1)
                    paths["fp8x8_" + "x".join(map(str, cfg))] = (lambda c=LinearConfig(*cfg): kernel(c, True), 1)
            if block:
                paths["block_gemm"] = (lambda: act(f8.prefill_linear(x, *next(fp8_w), pdl=pdl, block=True)), 1)
                if rows > f8.FP8_MAX_ROWS:
                    for cfg in FP8_GEMM_SWEEP:
                        paths["block_gemm_" + "x".join(map(str, cfg))] = (
                            lambda c=f8.GemmConfig(*cfg): act(f8.block_scaled_linear(x, *next(fp8_w), config=c)), 1)
            else:
                xq, xs = f8.quantize_rows(x)

                def scaled_mm_only():
                    qq, ss = next(fp8_w)
                    return act(torch._scaled_mm(xq, qq.t(), scale_a=xs, scale_b=ss.view(1, -1),
                                                out_dtype=torch.bfloat16))

                paths["scaled_mm"] = (lambda: act(f8.prefill_linear(x, *next(fp8_w), pdl=pdl, block=False)), 1)
                paths["scaled_mm_only"] = (scaled_mm_only, 1)

            def dequant_cublas():
                qq, ss = next(fp8_w)
                return act(torch_layers.linear(x, qq, scale=ss))

            paths["dequant_cublas"] = (dequant_cublas, 1)
            row = dict(shape=name, rows=rows, scales=scales, ms={}, tb_per_s={})
            if prefill:
                row["tflop_per_s"] = {}
            for label, (fn, itemsize) in paths.items():
                r = _guarded(lambda **_: dict(ms=_time_graph(fn, replays=5 if prefill else 20,
                                                             repeats=3 if prefill else 7, chain=chain)))
                if r["ms"] != r["ms"]:
                    row.setdefault("errors", {})[label] = r.get("error", "")
                    continue
                row["ms"][label] = r["ms"]
                row["tb_per_s"][label] = n * k * itemsize / r["ms"] / 1e9
                if prefill:
                    row["tflop_per_s"][label] = 2 * rows * n * k / r["ms"] / 1e9
            row["best"] = min(row["ms"], key=row["ms"].get) if row["ms"] else None
            row["auto"] = str((f8.choose_gated_config if gated else f8.choose_config)(
                n, k, buffers.sm_count(w.device), block))
            out.append(row)
            shown = " ".join(f"{p}={row['ms'][p] * 1e3:.1f}us({row['tb_per_s'][p]:.2f})"
                             for p in ("bf16_cublas", "bf16_kernel", "fp8_auto", "fp8x8_auto", "scaled_mm",
                                       "block_gemm")
                             if p in row["ms"])
            best = row["best"]
            print(f"  {name:11s} rows={rows:4d} {scales} {shown} best={best} "
                  f"{row['ms'][best] * 1e3 if best else float('nan'):.1f}us", flush=True)
            del x, paths
        del w, q, s, bf16_w, fp8_w
        torch.cuda.empty_cache()
    return out


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sweep", action="store_true", help="also sweep decode launch configurations")
    ap.add_argument("--linear", action="store_true", help="only the decode GEMMs: cuBLAS against ops/triton/linear.py")
    ap.add_argument("--shapes", default=None, help="--linear: comma-separated names of LINEAR_SHAPES (default all)")
    ap.add_argument("--rows", default=None, help="--linear: batch rows to time (default 1,32,64; with --fp8 "
                                                 "1,16,32,64,128,256)")
    ap.add_argument("--fp8", action="store_true", help="--linear: FP8 (e4m3) weights: the FP8 decode kernel, "
                                                       "_scaled_mm and the bf16 paths (FP8_LINEAR_SHAPES)")
    ap.add_argument("--fp8-scales", choices=("channel", "block"), default="channel",
                    help="--linear --fp8: per-channel or 128 x 128 block weight scales")
    ap.add_argument("--prefill-rows", default="2048,4096",
                    help="--linear --fp8: prompt-sized row counts timed with the GEMM paths only ('' for none)")
    ap.add_argument("--chain", type=int, default=1, help="--linear: calls back to back in one graph")
    ap.add_argument("--pdl", action="store_true", help="--linear: launch as programmatic dependents")
    ap.add_argument("--park", action="store_true", help="--linear: split-K partials left for the next kernel to add")
    ap.add_argument("--gated", action="store_true", help="--linear: W as [gate; up] with SiLU-and-mul fused in")
    ap.add_argument("--mixed", action="store_true", help="only mixed-step attention (MIXED_STEPS), by path and shape")
    ap.add_argument("--no-weight-pass", action="store_true", help="--linear: skip the whole-model weight passes")
    args = ap.parse_args(argv)
    _require_cuda()
    results = {"device": torch.cuda.get_device_name()}
    if args.mixed:
        results["mixed"] = [row for name in MIXED_STEPS for row in bench_mixed_attention(name)]
        for row in results["mixed"]:
            print("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        print(json.dumps(results, separators=(",", ":")))
        return 0
    if args.linear and args.fp8:
        shapes = {name: FP8_LINEAR_SHAPES[name] for name in args.shapes.split(",")} if args.shapes else None
        rows = tuple(int(r) for r in (args.rows or "1,16,32,64,128,256").split(","))
        prefill_rows = tuple(int(r) for r in args.prefill_rows.split(",") if r)
        results["linear_fp8"] = sweep_linear_fp8(rows, shapes, scales=args.fp8_scales, chain=args.chain,
                                                 pdl=args.pdl, park=args.park, gated=args.gated,
                                                 prefill_rows=prefill_rows)
        print(json.dumps(results, separators=(",", ":")))
        return 0
    if args.linear:
        from backend.ops.triton import linear as tlin

        shapes = {name: LINEAR_SHAPES[name] for name in args.shapes.split(",")} if args.shapes else None
        results["linear_sweep"] = sweep_linear(tuple(int(r) for r in (args.rows or "1,32,64").split(",")), shapes,
                                               chain=args.chain, pdl=args.pdl, park=args.park, gated=args.gated)
        for batch in () if args.no_weight_pass else (1, 32, 64):
            for label, fn in (("cublas", F.linear), ("triton", tlin.linear), ("tuned", tlin.tuned_linear)):
                results[f"weight_pass_b{batch}_{label}"] = r = bench_weight_pass(batch=batch, linear=fn)
                print(f"weight pass batch {batch} {label}: {r['ms']:.3f} ms {r['tb_per_s']:.3f} TB/s", flush=True)
        for label, fn in () if args.no_weight_pass else (("cublas", F.linear), ("tuned", tlin.tuned_linear)):
            results[f"weight_pass_layers_b32_{label}"] = r = bench_weight_pass(with_layers=True, linear=fn)
            print(f"weight pass + layers batch 32 {label}: {r['ms']:.3f} ms {r['tb_per_s']:.3f} TB/s", flush=True)
        print(json.dumps(results, separators=(",", ":")))
        return 0
    if args.sweep:
        results["decode_sweep"] = (sweep_decode() + sweep_decode(batch=64, context=1024, splits=(1, 2, 4))
                                   + sweep_decode(batch=4, context=32768, splits=(8, 16, 17, 32))
                                   + sweep_decode(batch=8, context=8192, splits=(4, 8, 16)))
        results["prefill_sweep"] = sweep_prefill()
        print("sweeps (32/8 heads, d128, bs16, bf16)")
        for row in results["decode_sweep"] + results["prefill_sweep"]:
            print("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k not in ("num_heads", "num_kv_heads",
                                                                                      "head_dim", "block_size")))
    shapes = {
        "decode_b32_4k": dict(batch=32, context=4096),
        "decode_b32_8k": dict(batch=32, context=8192),
        "decode_b32_4k_bs32": dict(batch=32, context=4096, block_size=32),
        "decode_b64_1k": dict(batch=64, context=1024),
        "decode_b4_32k": dict(batch=4, context=32768),
        "decode_b1_16k": dict(batch=1, context=16384),
        "decode_b32_4k_smollm": dict(batch=32, context=4096, num_heads=9, num_kv_heads=3, head_dim=64),
    }
    for name, kw in shapes.items():
        results[name] = bench_decode_attention(**kw)
    results["prefill_2k"] = bench_prefill_attention()
    results["prefill_8x512"] = bench_prefill_attention(num_tokens=4096, num_seqs=8)
    results["weight_pass"] = bench_weight_pass()
    results["weight_pass_fused_layers"] = bench_weight_pass(with_layers=True)

    print(f"{'benchmark':28s} {'ms':>9s} {'TB/s':>7s}  notes")
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        rate = r.get("tb_per_s")
        note = f"{r['tflop_per_s']:.0f} TFLOP/s" if "tflop_per_s" in r else (
            f"splits={r['num_splits']}" if "num_splits" in r else "")
        print(f"{name:28s} {r['ms']:9.4f} {rate if rate is not None else float('nan'):7.3f}  {note}")
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
