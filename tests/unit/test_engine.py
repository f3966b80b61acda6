"""The engine against transformers' own generate, on tiny random models, in synchronous and asynchronous mode."""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.ops import get_ops
from tests.tiny_models import EOS, build_tiny, hf_greedy, hf_model, kv_blocks_used_after_settling, random_prompts, \
    tiny_engine

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny"))


def make_engine(path, async_pipeline, **kw) -> Engine:
    return tiny_engine(path, async_pipeline, **{"num_kv_blocks": 96, "max_num_batched_tokens": 24, **kw})


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("graphs", [pytest.param(True, id="graph-step"), pytest.param(False, id="eager-step")])
@pytest.mark.parametrize("async_pipeline", MODES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_batch_equals_transformers(root, family, async_pipeline, graphs):
    """Mixed lengths (some longer than the step's token budget: chunked prefill), finishing at different steps.
    graph-step: decode steps take the decode-graph body (run eagerly on the CPU); eager-step: the plain path."""
    path = build_tiny(family, root)
    prompts = random_prompts([3, 30, 9, 57, 1, 16, 22, 5])
    lengths = [12, 20, 7, 16, 3, 20, 9, 14]
    want = [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    engine = make_engine(path, async_pipeline, cuda_graphs=graphs)
    try:
        outs = engine.generate(prompts, [greedy(n) for n in lengths])
        assert [o.token_ids for o in outs] == want
        assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


class _ForwardRecorder:
    """Wraps a model: records (tokens, longest query) of each forward, delegates everything else."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, ids, positions, kv_cache, meta, ops=None):
        self.calls.append((ids.shape[0], int(meta.max_query_len)))
        return self.model(ids, positions, kv_cache, meta, ops)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("budget,want_shapes", [(2048, [(1, 17), (3, 12), (37, 1), (37, 2)]),
                                                (40, [(1, 17), (3, 12), (37, 1)]), (24, [(1, 17)]), (8, [(1, 8)])])
def test_prefill_warm_up_runs_in_budget_and_leaves_requests_exact(root, budget, want_shapes):
    """The eager forward's start-up warm-up (CUDA engines run it before the graphs are captured, so the first
    requests compile nothing): the shapes that fit the step's token budget and sequence limit, all in the null
    block; afterwards no KV block is held and greedy tokens still equal transformers'."""
    path = build_tiny("llama", root)
    prompts = random_prompts([3, 30, 9, 57])
    want = [hf_greedy(path, p, 12) for p in prompts]
    engine = make_engine(path, True, max_num_batched_tokens=budget, max_num_seqs=min(budget, 48))
    try:
        recorder = _ForwardRecorder(engine.runner.model)
        engine.runner.model = recorder
        assert engine.runner.warm_up_prefill() == want_shapes
        assert recorder.calls == [(n * q, q) for n, q in want_shapes]
        assert engine.block_manager.num_used_blocks == 0
        assert [o.token_ids for o in engine.generate(prompts, greedy(12))] == want
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
@pytest.mark.parametrize("batch", [1, 16])
def test_batch_sizes(root, async_pipeline, batch):
    path = build_tiny("llama", root)
    prompts = random_prompts([(7 * i) % 40 + 1 for i in range(batch)], seed=batch)
    want = [hf_greedy(path, p, 10) for p in prompts]
    engine = make_engine(path, async_pipeline)
    try:
        assert [o.token_ids for o in engine.generate(prompts, greedy(10))] == want
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_requests_join_every_step(root, async_pipeline):
    """Each new request arrives once the previous one has produced a token, so the batch changes every step."""
    path = build_tiny("llama", root)
    prompts = random_prompts([11, 4, 26, 8, 15, 2], seed=7)
    want = [hf_greedy(path, p, 16) for p in prompts]
    engine = make_engine(path, async_pipeline)
    try:
        streams = []
        for p in prompts:
            s = engine.add_request(p, greedy(16))
            next(s)  # wait for the first token before the next request joins
            streams.append(s)
        got = [s.result().token_ids for s in streams]
        assert got == want
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_one_token_prefill_chunks_beside_decodes(root, async_pipeline):
    """A step budget of 2 tokens for 2 requests: once one decodes, the other's prompt advances one token a step,
    so decode-only steps hold a prompt token that samples nothing. Outputs still equal transformers'."""
    path = build_tiny("llama", root)
    prompts = random_prompts([2, 9], seed=11)
    want = [hf_greedy(path, p, 12) for p in prompts]
    engine = make_engine(path, async_pipeline, max_num_seqs=2, max_num_batched_tokens=2)
    try:
        outs = engine.generate(prompts, greedy(12))
        assert [o.token_ids for o in outs] == want
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_preemption_keeps_outputs_equal(root, async_pipeline):
    """A KV cache too small for all requests at once: requests are preempted and recomputed, outputs unchanged."""
    path = build_tiny("qwen2", root)
    prompts = random_prompts([20, 18, 25, 22, 19, 24], seed=3)
    want = [hf_greedy(path, p, 24) for p in prompts]
    engine = make_engine(path, async_pipeline, num_kv_blocks=24, max_num_batched_tokens=64)
    try:
        outs = engine.generate(prompts, greedy(24))
        assert [o.token_ids for o in outs] == want
        assert engine.stats()["preemptions"] > 0
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_prefix_cache_hits_are_counted_and_exact(root, async_pipeline):
    path = build_tiny("llama", root)
    system = random_prompts([33], seed=11)[0]
    tails = random_prompts([5, 9, 2], seed=12)
    prompts = [system + t for t in tails]
    want = [hf_greedy(path, p, 12) for p in prompts]
    engine = make_engine(path, async_pipeline)
    try:
        first = engine.generate(prompts[:1], greedy(12))
        rest = engine.generate(prompts[1:], greedy(12))
        assert [o.token_ids for o in first + rest] == want
        stats = engine.stats()
        assert stats["prefix_cache_hits"] >= 2 * (33 // 4)  # both later prompts reuse the shared blocks
        assert rest[0].num_cached_tokens == 32
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_a_running_requests_prompt_blocks_serve_a_request_that_arrives_meanwhile(root, async_pipeline):
    """A prompt's full blocks are hashed as soon as they are computed: a request sharing its first 33 tokens that
    arrives while it still decodes reuses them (its outputs' blocks are hashed only when it finishes)."""
    path = build_tiny("llama", root)
    system = random_prompts([33], seed=13)[0]
    first, second = system + random_prompts([6], seed=14)[0], system + random_prompts([3], seed=15)[0]
    engine = make_engine(path, async_pipeline)
    try:
        stream = engine.add_request(first, greedy(250))
        for out in stream:
            if len(out.token_ids) >= 5:
                break
        late = engine.generate([second], greedy(6))[0]
        assert engine.stats()["running"] == 1  # the first still decodes
        assert late.num_cached_tokens == 32
        assert late.token_ids == hf_greedy(path, second, 6)
        assert len(stream.result().token_ids) == 250
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_abort_mid_generation_returns_blocks(root, async_pipeline):
    path = build_tiny("llama", root)
    engine = make_engine(path, async_pipeline)
    try:
        keep = engine.add_request(random_prompts([6], seed=5)[0], greedy(30))
        stream = engine.add_request(random_prompts([10], seed=4)[0], greedy(300), request_id="victim")
        seen = 0
        for out in stream:
            seen += len(out.delta_token_ids)
            if seen >= 3:
                engine.abort("victim")
                break
        final = stream.result() if not out.finished else out
        assert final.finished and final.finish_reason == "abort"
        assert 3 <= len(final.token_ids) < 300
        assert keep.result().finish_reason == "length"
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_eos_stop_ids_and_max_tokens(root, async_pipeline):
    path = build_tiny("llama", root)
    prompt = random_prompts([12], seed=9)[0]
    free_run = hf_greedy(path, prompt, 20)
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    engine = make_engine(path, async_pipeline)
    try:
        by_id, by_len = engine.generate(
            [prompt, prompt],
            [SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok]), greedy(7)])
        assert by_id.token_ids == free_run[:first + 1] and by_id.finish_reason == "stop"
        assert by_len.token_ids == free_run[:7] and by_len.finish_reason == "length"
    finally:
        engine.shutdown()
    # a model whose EOS is a token greedy decoding reaches: generation ends there, as in transformers
    want = hf_greedy(path, prompt, 20, eos=stop_tok)
    assert want[-1] == stop_tok and len(want) < 20
    eos_path = os.path.join(root, f"eos-{async_pipeline}")
    shutil.copytree(path, eos_path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(eos_path, name)
        if os.path.exists(file):
            data = json.load(open(file))
            data["eos_token_id"] = stop_tok
            json.dump(data, open(file, "w"))
    engine = make_engine(eos_path, async_pipeline)
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0]
        assert out.token_ids == want and out.finish_reason == "stop"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_seeded_sampling_is_reproducible_across_batches(root, async_pipeline):
    path = build_tiny("qwen3", root)
    prompt = random_prompts([9], seed=21)[0]
    others = random_prompts([4, 17, 30], seed=22)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    engine = make_engine(path, async_pipeline)
    try:
        alone = engine.generate([prompt], params)[0].token_ids
        mixed = engine.generate(others[:2] + [prompt] + others[2:],
                                [SamplingParams(max_tokens=16, temperature=0.7, seed=5, ignore_eos=True)] * 2
                                + [params] + [greedy(16)])[2].token_ids
        other_seed = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9,
                                                              seed=99, ignore_eos=True))[0].token_ids
    finally:
        engine.shutdown()
    engine = make_engine(path, not async_pipeline)
    try:
        again = engine.generate([prompt], params)[0].token_ids
    finally:
        engine.shutdown()
    engine = make_engine(path, async_pipeline, cuda_graphs=False)  # the sampler reads eager logits, not a graph's
    try:
        eager = engine.generate([prompt], params)[0].token_ids
    finally:
        engine.shutdown()
    assert alone == mixed == again == eager
    assert alone != other_seed


def test_repetition_penalty_matches_transformers(root):
    path = build_tiny("llama", root)
    prompts = random_prompts([6, 19], seed=31)
    want = [hf_greedy(path, p, 16, repetition_penalty=1.5) for p in prompts]
    for async_pipeline in (False, True):
        engine = make_engine(path, async_pipeline)
        try:
            outs = engine.generate(prompts, greedy(16, repetition_penalty=1.5))
            assert [o.token_ids for o in outs] == want
        finally:
            engine.shutdown()


def test_logprobs_match_transformers_scores(root):
    import torch

    path = build_tiny("llama", root)
    prompt = random_prompts([8], seed=41)[0]
    model = hf_model(path)
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref = [torch.log_softmax(l[0].float(), -1) for l in gen.logits]
    engine = make_engine(path, True)
    try:
        out = engine.generate([prompt], greedy(6, logprobs=3))[0]
    finally:
        engine.shutdown()
    assert len(out.logprobs) == 6
    for entry, lp in zip(out.logprobs, ref):
        assert entry["logprob"] == pytest.approx(lp[entry["token_id"]].item(), abs=1e-4)
        top = torch.topk(lp, 3)
        assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist()


def test_bad_requests_raise_clear_errors(root):
    path = build_tiny("llama", root)
    engine = make_engine(path, True, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="empty"):
            engine.add_request([], greedy(4))
        with pytest.raises(ValueError, match="no tokens"):  # text the tokenizer drops whole
            engine.add_request(" \t ", greedy(4))
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request([1, 999], greedy(4))
        with pytest.raises(ValueError, match="maximum model length"):
            engine.add_request(list(range(2, 62)), greedy(10))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([5], SamplingParams(stop_token_ids=[4096]))
        engine.add_request([5, 6], greedy(3), request_id="same")
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request([5, 6], greedy(3), request_id="same")
        assert engine.generate([[7, 8]], greedy(3))[0].finish_reason == "length"  # still serving
    finally:
        engine.shutdown()


@pytest.mark.parametrize("field,value,match", [
    ("max_tokens", 0, "max_tokens"), ("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"), ("top_k", -2, "top_k"), ("min_p", 1.5, "min_p"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("presence_penalty", 3.0, "presence_penalty"),
    ("frequency_penalty", -2.5, "frequency_penalty"), ("logprobs", 21, "logprobs"), ("seed", -1, "seed"),
    ("stop", [""], "stop"), ("min_tokens", 99, "min_tokens"),
])
def test_bad_sampling_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_unknown_sampling_key_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"max_tokens": 3, "temprature": 0.5})


@pytest.mark.parametrize("settings,match", [
    (dict(block_size=3), "power of two"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device"),
    (dict(max_num_batched_tokens=8, max_num_seqs=16), "max_num_batched_tokens"),
    (dict(kv_cache_memory_fraction=1.5), "kv_cache_memory_fraction"), (dict(attention_backend="x"), "attention"),
    (dict(linear_backend="cutlass"), "linear_backend must be auto, triton or cublas"),
    (dict(dependent_launch="yes"), "dependent_launch must be auto, decode, on or off"),
    (dict(gc_young_threshold=-1), "gc_young_threshold must be an integer >= 0"),
    (dict(dependent_decode_rows=-1), "dependent_decode_rows must be an integer >= 0"),
])
def test_bad_config(settings, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**settings).validate()


def test_dependent_launch_is_on_only_for_the_triton_path_on_a_gpu():
    """auto: never on CPU or on the torch path (where no Triton kernel runs); on and off are taken as said."""
    from backend.engine_setup import _dependent_launch

    cpu = torch.device("cpu")
    assert not _dependent_launch("auto", "torch", cpu)
    assert not _dependent_launch("auto", "triton", cpu)
    assert _dependent_launch("on", "triton", cpu) and _dependent_launch("decode", "triton", cpu)
    assert not _dependent_launch("off", "triton", cpu)
    ops = get_ops("torch", dependent_launch=True)  # the torch path has no launches to make dependent
    assert ops.name == "torch"


def test_config_from_strings_and_unknown_keys():
    cfg = EngineConfig.from_dict({"max_num_seqs": "8", "async_pipeline": "false", "num_kv_blocks": "none",
                                  "gc_young_threshold": "0"})
    assert cfg.max_num_seqs == 8 and cfg.async_pipeline is False and cfg.num_kv_blocks is None
    assert cfg.gc_young_threshold == 0
    with pytest.raises(ValueError, match="unknown engine setting"):
        EngineConfig.from_dict({"max_seqs": "8"})
    with pytest.raises(ValueError, match="integer"):
        EngineConfig.from_dict({"max_num_seqs": "eight"})


@pytest.mark.parametrize("async_pipeline", MODES)
def test_min_tokens_masks_stop_tokens(root, async_pipeline):
    """Before min_tokens the stop token cannot be sampled; transformers' min_new_tokens does the same."""
    path = build_tiny("llama", root)
    prompt = random_prompts([12], seed=9)[0]
    free_run = hf_greedy(path, prompt, 20)
    stop_tok = free_run[2]
    want = hf_greedy(path, prompt, 20, eos=[stop_tok, EOS], min_new_tokens=8)  # EOS is banned too
    engine = make_engine(path, async_pipeline)
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok],
                                                       min_tokens=8))[0]
        assert out.token_ids == want
        assert stop_tok not in out.token_ids[:8]
    finally:
        engine.shutdown()


def test_injected_fault_fails_inflight_requests_and_engine_recovers(root):
    """A step that raises: every request in flight ends with an error, blocks return, new requests succeed."""
    path = build_tiny("llama", root)
    engine = make_engine(path, True, test_fault_every_n_steps=5)
    try:
        outs = engine.generate(random_prompts([4, 9, 13], seed=61), greedy(20))
        assert [o.finish_reason for o in outs] == ["error"] * 3
        assert all("injected fault" in o.error for o in outs)
        assert kv_blocks_used_after_settling(engine) == 0
        assert engine.healthy
        short = engine.generate([[5, 6, 7]], greedy(2))[0]  # fits between two faults
        assert short.finish_reason == "length" and len(short.token_ids) == 2
    finally:
        engine.shutdown()


def _assert_dead(engine) -> None:
    """The engine stops within 5 s and refuses new requests."""
    from backend import EngineDead

    deadline = time.time() + 5
    while engine.healthy and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.healthy
    with pytest.raises(EngineDead):
        engine.add_request([1, 2], greedy(2))


def test_faults_slower_than_the_idle_tick_still_add_up(root):
    """A fault that hits every request, one request at a time with the loop idle between them (longer than its
    0.5 s idle tick): idle ticks do not clear the count, so the third failed step marks the engine unhealthy."""
    path = build_tiny("llama", root)
    engine = make_engine(path, False, test_fault_every_n_steps=1)
    try:
        for n in range(3):
            assert engine.healthy, n
            out = engine.generate([[5, 6, 7]], greedy(4))[0]
            assert out.finish_reason == "error"
            time.sleep(0.7)  # longer than the loop's idle wait
        _assert_dead(engine)
    finally:
        engine.shutdown()


def test_repeated_faults_mark_the_engine_unhealthy(root):
    from backend import EngineDead

    path = build_tiny("llama", root)
    engine = make_engine(path, False, test_fault_every_n_steps=1)
    try:
        for _ in range(3):
            try:
                out = engine.generate([[5, 6, 7]], greedy(4))[0]
                assert out.finish_reason in ("error", "abort")
            except EngineDead:
                break
        _assert_dead(engine)
    finally:
        engine.shutdown()


def test_shutdown_answers_every_request(root):
    path = build_tiny("llama", root)
    engine = make_engine(path, True)
    streams = [engine.add_request(p, greedy(300)) for p in random_prompts([5, 6, 7, 8], seed=71)]
    next(streams[0])
    engine.shutdown()
    finals = [s.result() for s in streams]
    assert all(f.finished for f in finals)
    assert {f.finish_reason for f in finals} <= {"abort", "length"}


def test_final_only_requests_send_one_event_each_and_keep_their_tokens_when_cut_short(root):
    """generate() and add_request(stream=False) want final outputs only: the loop sends the output thread one event
    per request, not one per token, and the final output says when the first token came; a request cut short
    (here by shutdown) still gets the tokens it had."""
    import threading

    path = build_tiny("llama", root)
    prompts = random_prompts([5, 9], seed=81)
    engine = make_engine(path, True)
    pushed = []
    push = engine.outputs.push
    engine.outputs.push = lambda events: (pushed.append(len(events)), push(events))[1]
    try:
        full = engine.generate(prompts, greedy(40))
        started = time.monotonic()
        single = engine.add_request(prompts[0], greedy(40), stream=False)  # a server's non-streaming request
        final = single.result()
    finally:
        engine.shutdown()
    assert sum(pushed) == 3
    assert [len(o.token_ids) for o in full] == [40, 40] and all(o.text for o in full)
    assert final.token_ids == full[0].token_ids and final.text == full[0].text
    assert started < final.first_token_time < time.monotonic()

    engine = make_engine(path, True)
    got = {}
    worker = threading.Thread(target=lambda: got.update(outs=engine.generate(prompts, greedy(300))))
    worker.start()
    deadline = time.monotonic() + 30
    while engine.loop.steps < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.shutdown()
    worker.join(30)
    outs = got["outs"]
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    for out, ref in zip(outs, full):
        n = min(len(out.token_ids), 40)
        assert 0 < len(out.token_ids) < 300 and out.token_ids[:n] == ref.token_ids[:n]
        assert out.num_tokens == len(out.token_ids)
