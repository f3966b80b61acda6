"""Sampler behaviour: greedy, seeded reproducibility, distributions, masks, penalties, logprobs, no host sync."""
import dataclasses

import numpy as np
import pytest
import torch

from backend.request import SamplingParams
from backend.executor.sampler import Sampler, apply_penalties, exponential_noise
from tests.sampling_helpers import SamplingBuffers, sampling_tensors_from_params


def build(params, logits_rows, seeds=None, steps=None, prompts=None, outputs=None):
    n = len(params)
    seeds = list(range(n)) if seeds is None else seeds
    steps = [0] * n if steps is None else steps
    st = sampling_tensors_from_params(params, seeds, steps, "cpu", prompts, outputs)
    return Sampler()(logits_rows, st), st


def random_logits(rows, vocab=512, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale  # (B, V)


def test_greedy_equals_argmax_bit_exact():
    logits = random_logits(6)
    out, st = build([SamplingParams(temperature=0)] * 6, logits)
    assert st.all_greedy
    assert torch.equal(out.token_ids, torch.argmax(logits, dim=-1))
    assert out.logprobs is None and out.top_ids is None


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    logits = random_logits(4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=3)] * 2
    out, st = build(params, logits)
    assert not st.all_greedy
    assert torch.equal(out.token_ids[0::2], logits.argmax(-1)[0::2])


def test_seeded_sampling_ignores_batch_composition_and_row_position():
    logits = random_logits(3, seed=1, scale=1.0)  # flat: many tokens have real probability
    a, b, c = (SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=0.7, top_k=40),
               SamplingParams(temperature=0))
    out1, _ = build([a, b, c], logits, seeds=[11, 22, 0], steps=[5, 9, 0])
    other = random_logits(2, seed=7)
    rows = torch.stack([other[0], logits[1], other[1], logits[0]])
    out2, _ = build([SamplingParams(temperature=2.0), b, c, a], rows, seeds=[99, 22, 0, 11], steps=[1, 9, 0, 5])
    assert out2.token_ids[3] == out1.token_ids[0] and out2.token_ids[1] == out1.token_ids[1]


def test_different_seeds_and_steps_draw_different_tokens():
    logits = random_logits(1, seed=2, scale=0.5).expand(64, -1)  # near uniform over 512 tokens
    params = [SamplingParams(temperature=1.0)] * 64
    by_seed, _ = build(params, logits, seeds=list(range(64)), steps=[3] * 64)
    by_step, _ = build(params, logits, seeds=[5] * 64, steps=list(range(64)))
    assert len(set(by_seed.token_ids.tolist())) > 40
    assert len(set(by_step.token_ids.tolist())) > 40
    again, _ = build(params, logits, seeds=list(range(64)), steps=[3] * 64)
    assert torch.equal(again.token_ids, by_seed.token_ids)


def test_noise_depends_only_on_seed_step_and_token():
    vocab_hash = Sampler().vocab_hash(100, torch.device("cpu"))
    seeds, steps = torch.tensor([1, 2**40 + 3, 1]), torch.tensor([0, 7, 0])
    noise = exponential_noise(seeds, steps, vocab_hash)  # (3, 100)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert torch.equal(exponential_noise(seeds[1:2], steps[1:2], vocab_hash)[0], noise[1])
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    many = exponential_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), Sampler().vocab_hash(1024, "cpu"))
    assert abs(many.mean().item() - 1.0) < 0.02 and abs(many.var().item() - 1.0) < 0.05  # Exp(1): mean 1, var 1


def chi_square(tokens, probs, draws):
    counts = np.bincount(tokens.numpy(), minlength=probs.numel())
    expected = probs.double().numpy() * draws
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token with zero probability"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_temperature_sampling_matches_softmax(temperature):
    draws = 4000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    params = [SamplingParams(temperature=temperature)] * draws
    out, _ = build(params, logits.expand(draws, -1), seeds=[1234] * draws, steps=list(range(draws)))
    stat, dof = chi_square(out.token_ids, torch.softmax(logits / temperature, -1), draws)
    assert stat < 30.0, (stat, dof)  # chi-square 7 dof: P(> 30) ~ 1e-4; fixed seeds make it deterministic


def test_top_k_and_top_p_sampling_renormalise_the_kept_tokens():
    draws = 3000
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    probs = torch.softmax(logits, -1)
    for params, kept in ((SamplingParams(temperature=1.0, top_k=3), 3),
                         (SamplingParams(temperature=1.0, top_p=0.8), 3)):  # 0.48 + 0.29 < 0.8 -> 3 tokens
        out, _ = build([params] * draws, logits.expand(draws, -1), seeds=[7] * draws, steps=list(range(draws)))
        target = torch.zeros_like(probs)
        target[:kept] = probs[:kept] / probs[:kept].sum()
        stat, dof = chi_square(out.token_ids, target, draws)
        assert dof == kept - 1 and stat < 20.0, (params, stat)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = random_logits(8, seed=3)
    greedy = logits.argmax(-1)
    for params in (SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=1.3, top_p=1e-6),
                   SamplingParams(temperature=1.0, top_k=1, top_p=0.5)):
        out, _ = build([params] * 8, logits, seeds=list(range(8)))
        assert torch.equal(out.token_ids, greedy), params


def test_top_k_fast_path_matches_sort_path():
    logits = random_logits(16, vocab=800, seed=4)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (5, 0, 20, 1) * 4]
    _, st = build(params, logits)
    assert st.max_top_k == 20
    fast = Sampler()(logits, st).token_ids
    slow = Sampler()(logits, dataclasses.replace(st, any_top_p=True)).token_ids  # top_p 1: neutral
    assert torch.equal(fast, slow)


def test_min_p_masks_tokens_below_the_fraction_of_the_best():
    draws = 2000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08]))  # min_p 0.2: keep p >= 0.1
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * draws
    out, st = build(params, logits.expand(draws, -1), seeds=[3] * draws, steps=list(range(draws)))
    assert st.any_min_p
    assert set(out.token_ids.tolist()) == {0, 1, 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    _, st = build(params, logits, prompts=[[0]], outputs=[[1, 1, 4]])
    expected = torch.tensor([[1.0, -2.0, 0.5, -3.0, 0.5]])  # tokens 0 (prompt), 1 and 4 (output)
    assert torch.equal(apply_penalties(logits, st), expected)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)]
    _, st = build(params, logits, prompts=[[0, 0, 3]], outputs=[[1, 2, 2, 2]])
    expected = torch.tensor([[1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75, 1.0]])
    assert torch.allclose(apply_penalties(logits, st), expected, atol=0, rtol=0)


def test_penalty_steers_greedy_and_neutral_rows_are_untouched():
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0)]
    out, _ = build(params, logits, prompts=[[2], [2]], outputs=[[0], [0]])
    assert out.token_ids.tolist() == [1, 0]


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = random_logits(5, seed=5)
    params = [SamplingParams(temperature=0.8, logprobs=3, repetition_penalty=1.3)] + \
             [SamplingParams(temperature=0, logprobs=0)] * 4
    out, st = build(params, logits, prompts=[[1, 2]] * 5, outputs=[[3]] * 5)
    assert st.num_logprobs == 3
    reference = torch.log_softmax(logits, -1)  # before penalties and temperature
    assert torch.equal(out.logprobs, reference.gather(1, out.token_ids[:, None])[:, 0])
    top_lp, top_ids = reference.topk(3, -1)
    assert torch.equal(out.top_ids, top_ids) and torch.equal(out.top_logprobs, top_lp)
    # rank: 1 + the tokens strictly more likely; the greedy rows took a maximum, rank 1
    order = [sorted(row.tolist(), reverse=True) for row in reference]
    want = [order[b].index(reference[b, t].item()) + 1 for b, t in enumerate(out.token_ids.tolist())]
    assert out.ranks.tolist() == want and want[1:] == [1, 1, 1, 1]


def test_sampler_reads_nothing_back_to_the_host(monkeypatch):
    logits = random_logits(6, seed=6)
    busy = SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                          presence_penalty=0.1, frequency_penalty=0.1, logprobs=2)
    params = [busy, SamplingParams(temperature=0)] * 3
    st = sampling_tensors_from_params(params, list(range(6)), [4] * 6, "cpu", [[1, 2]] * 6, [[3, 3]] * 6)
    sampler = Sampler()

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation in the sampler")

    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for st_variant in (st, dataclasses.replace(st, any_top_k=False), dataclasses.replace(st, all_greedy=True)):
        out = sampler(logits, st_variant)
    monkeypatch.undo()
    assert out.token_ids.shape == (6,)


def test_preallocated_buffers_keep_addresses_and_pad_greedy_rows():
    buffers = SamplingBuffers(8, "cpu")
    first = buffers.fill([SamplingParams(temperature=0.5, top_k=3)] * 3, [1, 2, 3], [0, 1, 2], batch_size=4)
    second = buffers.fill([SamplingParams(temperature=0.9)] * 2, [4, 5], [3, 4], batch_size=4)
    assert first.temperature.data_ptr() == second.temperature.data_ptr()
    assert first.seeds.data_ptr() == second.seeds.data_ptr()
    assert second.temperature.tolist() == pytest.approx([0.9, 0.9, 0.0, 0.0])
    assert second.top_k.dtype == torch.int32 and second.seeds.tolist() == [4, 5, 0, 0]
    assert not second.any_top_k and first.any_top_k
    logits = random_logits(4, seed=8)
    fresh = sampling_tensors_from_params([SamplingParams(temperature=0.9)] * 2, [4, 5], [3, 4], "cpu")
    assert torch.equal(Sampler()(logits, second).token_ids[:2], Sampler()(logits[:2], fresh).token_ids)


def test_request_columns_equal_the_host_rows_and_their_bits_the_flags():
    """The request read (rows joining the decode rows, prefill rows, many rows at once) writes what fill_host_rows
    writes from the same params, seeds and step indices, and its per-row flag bits give row_flags' flags (logprobs
    asked included) for every subset of rows: float32 edges (a temperature that is 0 in float32, a top_p that rounds to
    1), top_k past int32, seeds past int63, greedy rows with sampling settings."""
    import itertools
    import random

    from backend.executor.sampler import fill_request_rows, flags_of_bits, request_columns, row_flags
    from tests.sampling_helpers import fill_host_rows
    from backend.request import Request

    settings = [dict(temperature=0.0), dict(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2),
                dict(temperature=1e-46), dict(temperature=0.7, top_p=1 - 1e-9), dict(temperature=0.7, top_p=0.95),
                dict(temperature=1.0, top_k=2**40), dict(temperature=0.8, top_k=50, min_p=0.05),
                dict(temperature=0.0, repetition_penalty=1.2), dict(temperature=0.9, presence_penalty=-0.5),
                dict(temperature=0.5, frequency_penalty=1e-9), dict(temperature=0.6, top_k=-1, top_p=0.3)]
    seeds = [0, 7, 2**63 + 5, 2**64 - 1, 2**70 + 3, 12345]
    rng = random.Random(5)
    reqs = []
    for i, kw in enumerate(settings):
        req = Request(f"r{i}", [3] * 5, SamplingParams(max_tokens=20, **kw), seed=seeds[i % len(seeds)],
                      eos_token_ids=frozenset())
        req.num_tokens += rng.randrange(1, 9)  # outputs so far: the step index
        reqs.append(req)

    def arrays(n):
        return np.zeros((6, n), np.float32), np.zeros((2, n), np.int64), np.zeros(n, np.int32)

    for m in (1, 2, 3):
        for rows in itertools.combinations(reqs, m) if m < 3 else [reqs, reqs[::2], reqs[1::3]]:
            rows = list(rows)
            f, i, k = arrays(len(rows))
            want_flags = fill_host_rows([r.params for r in rows], [r.seed for r in rows],
                                        [r.num_output_tokens - 1 for r in rows], f, i, k)
            got_f, got_i = request_columns(rows)
            np.testing.assert_array_equal(got_f, f)
            np.testing.assert_array_equal(got_i[:2], i)
            np.testing.assert_array_equal(got_i[2], k)
            assert flags_of_bits(int(np.bitwise_or.reduce(got_i[4])), int(got_i[3].max()), -1) == want_flags
            assert row_flags(f, k, -1) == want_flags
            got = arrays(len(rows))
            assert fill_request_rows(rows, *got) == want_flags
            for g, w in zip(got, (f, i, k)):
                np.testing.assert_array_equal(g, w)
    asks = [Request("a", [3] * 5, SamplingParams(max_tokens=9, temperature=0.5, logprobs=k), seed=1,
                    eos_token_ids=frozenset()) for k in (None, 3, 0)]
    for rows, most in ((asks[:1], -1), (asks, 3), (asks[::2], 0)):
        assert fill_request_rows(rows, *arrays(len(rows)))["num_logprobs"] == most


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError):
        sampling_tensors_from_params([SamplingParams()], [1, 2], [0], "cpu")
    with pytest.raises(ValueError):
        sampling_tensors_from_params([SamplingParams(repetition_penalty=1.5)], [1], [0], "cpu")
    st = sampling_tensors_from_params([SamplingParams()], [1], [0], "cpu")
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), st)
    with pytest.raises(ValueError):
        SamplingBuffers(4, "cpu").fill([SamplingParams()] * 3, [1] * 3, [0] * 3, batch_size=2)


def test_penalties_ignore_padding_and_out_of_vocab_ids():
    logits = torch.tensor([[0.0, 1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    _, st = build(params, logits, prompts=[[5, -1]], outputs=[[]])  # out-of-vocab id and padding are ignored
    assert torch.equal(apply_penalties(logits, st), logits)


def full_flags(st):
    """Every optional stage on, as a graph captured once for all batches would run."""
    return dataclasses.replace(st, any_top_k=True, any_top_p=True, any_min_p=True, num_logprobs=4)


@pytest.mark.gpu
def test_cuda_matches_cpu_and_never_synchronises():
    logits = random_logits(64, vocab=4096, seed=9)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, logprobs=4, seed=i) for i in range(63)]
    params.append(SamplingParams(temperature=0))
    seeds, steps = [2**40 + i for i in range(64)], list(range(64))
    cpu_noise = exponential_noise(torch.tensor(seeds), torch.tensor(steps), Sampler().vocab_hash(4096, "cpu"))
    cuda_noise = exponential_noise(torch.tensor(seeds).cuda(), torch.tensor(steps).cuda(),
                                   Sampler().vocab_hash(4096, "cuda"))
    torch.testing.assert_close(cuda_noise.cpu(), cpu_noise, rtol=1e-6, atol=0)  # same hash bits, log within an ulp
    cpu = Sampler()(logits, sampling_tensors_from_params(params, seeds, steps, "cpu")).token_ids
    buffers, sampler = SamplingBuffers(128, "cuda"), Sampler()
    sampler.vocab_hash(4096, torch.device("cuda"))
    device_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = buffers.fill(params, seeds, steps, batch_size=64)
        out = sampler(device_logits, st)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.token_ids.cpu(), cpu)


@pytest.mark.gpu
def test_sampler_replays_from_a_cuda_graph_with_static_buffers():
    logits = random_logits(32, vocab=4096, seed=10).cuda()
    buffers, sampler = SamplingBuffers(32, "cuda"), Sampler()
    first = [SamplingParams(temperature=0.7, top_p=0.8)] * 32
    st = full_flags(buffers.fill(first, list(range(32)), [0] * 32))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream before capture, as torch.cuda.graphs asks
        for _ in range(2):
            sampler(logits, st)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sampler(logits, st)
    second = [SamplingParams(temperature=1.2, top_k=5, min_p=0.1, seed=i) for i in range(20)]
    st2 = full_flags(buffers.fill(second, list(range(100, 120)), list(range(20)), batch_size=32))
    graph.replay()
    eager = sampler(logits, st2)
    assert torch.equal(captured.token_ids, eager.token_ids)
    assert torch.equal(captured.top_ids, eager.top_ids)
