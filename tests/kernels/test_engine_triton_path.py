"""The engine end to end on the Triton path, on a CPU under Triton's interpreter: greedy tokens equal the torch path's.

Without CUDA the Triton-language kernels run interpreted (tests/conftest.py), so this drives the host side of the
CUDA path through the whole engine: the dispatch between fused and unfused kernels, parked split-K partial sums,
the tuning-table lookups, the dependent-launch flags and the start-up warm-up. Each branch is forced at least once
and the test checks that it ran, from a log of every kernel launch and its flags:

- tuning tables of this model's own shapes (TINY_TABLES, in place of the H200's) park the qkv, o and down GEMMs'
  partials at 16 rows, fuse gate_up with SiLU-and-mul at 16 and 64 rows, run o as a serial split-K GEMM and qkv
  and gate_up unsplit at 32 rows, and leave the rest to F.linear;
- 4 "SMs" make one wave 16 decode programs: decode steps of up to 8 sequences (× 2 KV heads) take the fused
  rotary + KV write + attention kernel, larger ones rope_write_kv and the decode kernel;
- context splits from 16 tokens on, so short contexts decode with splits and the reduce kernel, and one split
  where the batch alone fills the wave (an unfused decode step never splits: the batch that leaves the one wave
  already fills the GPU).
On CUDA the real tables and shapes are covered by tests/gpu/test_engine_cuda.py instead.
"""
from __future__ import annotations

import collections

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.executor.packer import SlotPacker
from backend.executor.runner import ModelRunner
from tests.tiny_models import build_tiny, random_prompts

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run; CUDA: tests/gpu")]

from backend.ops.triton import buffers, argmax as triton_argmax, attention as triton_attention, layers as triton_layers, linear as triton_linear  # noqa: E402

LC = triton_linear.LinearConfig
QKV, O, GATE_UP, DOWN, LM_HEAD = (256, 128), (128, 128), (512, 128), (128, 256), (256, 128)  # (N, K) of llama-128
TINY_TABLES = triton_linear.TuningTables(
    plain={(*LM_HEAD, 16): LC(128, 64, 4, 2), (*QKV, 32): LC(128, 64, 4, 2), (*GATE_UP, 32): LC(128, 64, 4, 2),
           (*O, 32): LC(64, 64, 4, 2, split_k=2), (*O, 64): LC(64, 64, 4, 2, split_k=2)},
    parked={(*QKV, 16): LC(128, 64, 4, 2, split_k=2), (*O, 16): LC(64, 64, 4, 2, split_k=2),
            (*DOWN, 16): LC(64, 64, 4, 2, split_k=4), (*QKV, 64): LC(128, 64, 4, 2, split_k=2)},
    gated={(*GATE_UP, 16): LC(128, 64, 4, 2), (*GATE_UP, 64): LC(128, 64, 4, 2)},
)
PROMPT_LENS = [30, 28, 5, 17, 20, 3, 9, 24, 12, 7, 13, 2]
MAX_TOKENS = [2 + (i * 7) % 13 for i in range(len(PROMPT_LENS))]  # 2..14: the batch shrinks step by step
SETTINGS = dict(device="cpu", dtype="float16", num_kv_blocks=64, block_size=16, max_num_batched_tokens=64,
                max_model_len=256)


class LaunchLog:
    """Counts the launches of wrapped Triton kernels by a description of each (its name and chosen flags)."""

    def __init__(self, monkeypatch) -> None:
        self.seen: collections.Counter = collections.Counter()
        self._monkeypatch = monkeypatch

    def wrap(self, module, name: str, describe) -> None:
        kernel, seen = getattr(module, name), self.seen

        class Spy:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def run(*args, **kwargs):
                    seen[describe(args, kwargs)] += 1
                    return launch(*args, **kwargs)
                return run

        self._monkeypatch.setattr(module, name, Spy())


def _linear_kind(args, kw) -> tuple:
    weight = tuple(args[1].shape)
    if kw["GATED"]:
        return "gated gate_up", kw["PDL"]
    if kw["PARK"]:
        return f"parked {weight}", kw["PDL"]
    return ("split-K" if kw["SPLIT_K"] > 1 else "unsplit") + " GEMM", kw["PDL"]


def _decode_kind(args, kw) -> tuple:
    return ("fused rope decode" if kw["ROPE"] else "decode") + (", one split" if kw["DIRECT"] else ", splits"), \
        kw["PDL"]


@pytest.fixture
def launches(monkeypatch) -> LaunchLog:
    """The interpreter's stand-ins for an H200 (see the module docstring), and a log of every kernel launch."""
    monkeypatch.setattr(triton_linear, "tables_for", lambda device: TINY_TABLES)
    monkeypatch.setattr(buffers, "sm_count", lambda device: 4)
    monkeypatch.setattr(triton_attention, "DECODE_MIN_SPLIT_TOKENS", 16)
    log = LaunchLog(monkeypatch)
    log.wrap(triton_linear, "_skinny_linear_kernel", _linear_kind)
    log.wrap(triton_attention, "_decode_kernel", _decode_kind)
    for module, name in ((triton_attention, "_decode_reduce_kernel"), (triton_attention, "_prefill_kernel"),
                         (triton_layers, "_rope_write_kv_kernel"), (triton_layers, "_rms_norm_kernel"),
                         (triton_layers, "_silu_and_mul_kernel"), (triton_argmax, "_chunk_max_kernel")):
        log.wrap(module, name, lambda args, kw, name=name: (name, kw["PDL"]))
    return log


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_tiny("llama-128", str(tmp_path_factory.mktemp("tiny-triton")), seed=1)


@pytest.fixture(scope="module")
def torch_tokens(model_path) -> list[list[int]]:
    tokens, ops = _generate(model_path, attention_backend="torch", max_num_seqs=12)
    assert ops == "torch"
    return tokens


def _generate(path: str, **settings) -> tuple[list[list[int]], str]:
    engine = Engine(EngineConfig(model=path, **SETTINGS, **settings))
    try:
        prompts = random_prompts(PROMPT_LENS, seed=3)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
        return [o.token_ids for o in engine.generate(prompts, params)], engine.parts.model.ops.name
    finally:
        engine.shutdown()


ALL_PLAIN_LAUNCHES = {("_decode_reduce_kernel",), ("_prefill_kernel",), ("_rope_write_kv_kernel",),
                      ("_rms_norm_kernel",), ("_silu_and_mul_kernel",)}
DISPATCH = {"gated gate_up", f"parked {QKV}", f"parked {O}", f"parked {DOWN}", "split-K GEMM", "unsplit GEMM",
            "fused rope decode, one split", "fused rope decode, splits", "decode, one split"}


@pytest.mark.parametrize("pdl,graphs,async_pipeline,max_num_seqs", [(False, True, True, 40), (True, False, False, 12)],
                         ids=["pdl-off-graph-body-async", "pdl-on-eager-sync"])
def test_triton_path_greedy_equals_torch_path(model_path, torch_tokens, launches, monkeypatch, pdl, graphs,
                                              async_pipeline, max_num_seqs):
    """Greedy tokens of the Triton path equal the torch path's, with every dispatch branch taken at least once
    and every kernel launched with dependent launch as asked; 40 sequences allowed: the whole start-up warm-up."""
    warm_ups = []
    original = ModelRunner.warm_up_prefill
    monkeypatch.setattr(ModelRunner, "warm_up_prefill", lambda self: warm_ups.append(original(self)) or warm_ups[-1])
    mixed = []  # (tokens, bucket) of the steps with prefill chunks that ran as mixed graphs (their bodies here)
    pad_mixed = SlotPacker.pad_mixed
    monkeypatch.setattr(SlotPacker, "pad_mixed", lambda self, slot, seqs, num_tokens, tokens, *rest: mixed.append(
        (num_tokens, tokens)) or pad_mixed(self, slot, seqs, num_tokens, tokens, *rest))
    tokens, ops = _generate(model_path, attention_backend="triton", linear_backend="auto",
                            dependent_launch="on" if pdl else "off", cuda_graphs=graphs,
                            async_pipeline=async_pipeline, max_num_seqs=max_num_seqs)
    assert ops == ("triton+pdl" if pdl else "triton")
    assert tokens == torch_tokens
    kinds = {kind[:-1] for kind in launches.seen}
    graph_body = {("_chunk_max_kernel",)} if graphs else set()  # the decode graph's greedy pick (ops.greedy_argmax)
    assert {(k,) for k in DISPATCH} | ALL_PLAIN_LAUNCHES | graph_body <= kinds, sorted(launches.seen)
    assert {kind[-1] for kind in launches.seen} == {pdl}  # every launch with the dependent-launch flag asked for
    # with graphs, steps with prefill chunks are mixed graphs of 16, 32 or 64 tokens, some padded
    assert (any(t < b for t, b in mixed) and {b for _, b in mixed} <= {16, 32, 64}) if graphs else not mixed, mixed
    want_warm_up = [(1, 17), (3, 12), (37, 1)] if max_num_seqs >= 37 else [(1, 17), (3, 12)]
    assert warm_ups == [want_warm_up]  # (37, 2) is 74 tokens: over the 64-token step budget



def test_triton_path_samples_with_the_fused_kernel_alike_in_every_mode(model_path, monkeypatch):
    """Sampled requests (top-p, top-k, min-p, logprobs) on the Triton path go through the fused sampling kernel, and
    a seed gives the same tokens with the decode-graph body and the async pipeline as eagerly and synchronously."""
    from backend.ops.triton import sampling as triton_sampling

    log = LaunchLog(monkeypatch)
    log.wrap(triton_sampling, "_final_kernel", lambda args, kw: ("sample", kw["LOGPROBS"]))
    prompts = random_prompts(PROMPT_LENS[2:6], seed=4)
    kinds = [dict(max_tokens=4, temperature=0.8, top_p=0.9, seed=1), dict(max_tokens=3, temperature=1.2, top_k=7,
             seed=2), dict(max_tokens=4, temperature=0.0), dict(max_tokens=3, temperature=0.9, min_p=0.2, seed=3,
             logprobs=2)]
    params = [SamplingParams(ignore_eos=True, **kind) for kind in kinds]
    runs = []
    for graphs, async_pipeline in ((True, True), (False, False)):
        engine = Engine(EngineConfig(model=model_path, **SETTINGS, attention_backend="triton", cuda_graphs=graphs,
                                     async_pipeline=async_pipeline, max_num_seqs=8))
        try:
            runs.append([o.token_ids for o in engine.generate(prompts, params)])
        finally:
            engine.shutdown()
    assert runs[0] == runs[1]
    assert [len(t) for t in runs[0]] == [4, 3, 4, 3]
    assert {("sample", False), ("sample", True)} <= set(log.seen)


def test_dependent_launch_decode_splits_launches_by_kind_of_step(model_path, torch_tokens, monkeypatch):
    """dependent_launch "decode" (what auto is on an H200): every kernel of a decode step of at most
    dependent_decode_rows rows (padding included) launches as a programmatic dependent; every kernel of a larger
    decode step, of a mixed step (prefill chunks beside decode rows, a mixed graph's body here) and of an eager
    prefill launches plainly; the greedy tokens equal the torch path's."""
    monkeypatch.setattr(triton_linear, "tables_for", lambda device: TINY_TABLES)
    step = [None]  # ("decode", rows) or ("mixed",) while the runner's forward of that step runs

    def tracking(name: str, kind):
        original = getattr(ModelRunner, name)

        def forward(self, *args):
            step[0] = kind(args)
            try:
                return original(self, *args)
            finally:
                step[0] = None

        monkeypatch.setattr(ModelRunner, name, forward)

    tracking("decode_forward", lambda args: ("decode", args[2]))  # (slot, prev_slot, bucket, ...)
    tracking("mixed_forward", lambda args: ("mixed",))
    # (slot, B, T, width, max_len, max_q, ...): one-token rows are a decode step
    tracking("_eager_forward", lambda args: ("decode", args[1]) if args[5] == 1 else ("mixed",))
    log = LaunchLog(monkeypatch)
    for module, name in ((triton_linear, "_skinny_linear_kernel"), (triton_attention, "_decode_kernel"),
                         (triton_attention, "_prefill_kernel"), (triton_layers, "_rms_norm_kernel"),
                         (triton_layers, "_silu_and_mul_kernel"), (triton_argmax, "_chunk_max_kernel")):
        log.wrap(module, name, lambda args, kw, name=name: (name, step[0], kw["PDL"]))
    tokens, ops = _generate(model_path, attention_backend="triton", linear_backend="auto", dependent_launch="decode",
                            dependent_decode_rows=4, cuda_graphs=True, async_pipeline=True, max_num_seqs=12)
    assert ops == "triton+pdl" and tokens == torch_tokens
    kinds = collections.Counter()
    for name, kind, pdl in log.seen:
        assert kind is not None, f"{name} launched outside a step's forward"
        group = "mixed" if kind[0] == "mixed" else ("small decode" if kind[1] <= 4 else "large decode")
        assert pdl == (group == "small decode"), (name, kind, pdl)
        kinds[group] += 1
    assert set(kinds) == {"mixed", "small decode", "large decode"}, kinds


def test_drafted_steps_replay_the_mixed_or_a_verify_graph(model_path, torch_tokens, monkeypatch):
    """Speculation on the Triton path with graphs (their bodies here): every row drafts an oracle's tokens (every
    third proposal with a wrong last draft), and each drafted step replays the mixed graph of its token count where
    that graph's logits rows (8, the sequence limit) hold every drafted position, else the verify graph of that count;
    the greedy tokens equal the torch path's."""
    from backend.executor.graphs import DecodeGraphs
    from tests.unit.speculative.test_engine_speculation import OracleProposer

    chosen = []  # the graph of each drafted step
    replay_verify = DecodeGraphs.replay_verify
    monkeypatch.setattr(DecodeGraphs, "replay_verify",
                        lambda self, slot, graph: chosen.append(graph) or replay_verify(self, slot, graph))
    prompts = random_prompts(PROMPT_LENS, seed=3)
    engine = Engine(EngineConfig(model=model_path, **SETTINGS, attention_backend="triton", cuda_graphs=True,
                                 async_pipeline=True, max_num_seqs=8, speculative_method="ngram",
                                 num_speculative_tokens=4, speculative_adaptive=False))
    try:
        engine.speculator.proposer = OracleProposer([list(p) + t for p, t in zip(prompts, torch_tokens)])
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
        tokens = [o.token_ids for o in engine.generate(prompts, params)]
        counts = engine.speculator.counts()
    finally:
        engine.shutdown()
    assert tokens == torch_tokens
    assert 0 < counts["spec_accepted_tokens"] < counts["spec_proposed_tokens"]
    assert {kind for kind, _ in chosen} == {"mixed", "verify"}, chosen
    assert counts["spec_steps"] == len(chosen)
