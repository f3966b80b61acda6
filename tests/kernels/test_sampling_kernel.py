"""The fused sampling kernel (backend/ops/triton/sampling.py) against the torch sampler and exact references.

- greedy rows: the first maximum, bit for bit as torch.argmax;
- top-k, top-p and min-p: every pick lies in the kept set of the torch sampler's sort-based masks, and the noise is
  the same hash as the torch sampler's, so both pick the same token in all but a few rows (near-ties that float
  rounding orders differently);
- the draws follow the requested distribution (chi-square over many seeds, small vocabulary);
- a row's draw depends on its own seed and step only, not on the batch around it;
- logprobs, ranks and the log-sum-exp equal log_softmax's;
- the split passes (a row's vocabulary in chunks, one program each) draw what one chunk draws: the same race
  winners bit for bit, the same top-p decisions but for masses that round apart at the nucleus's edge.
Under Triton's interpreter (no CUDA) the sizes are smaller.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.kernels

import triton  # noqa: E402  (a test requirement: the interpreter runs these kernels without CUDA)

from backend.executor import sampler as torch_sampler  # noqa: E402
from backend.ops.triton import sampling as triton_sampling  # noqa: E402
from backend.ops.triton.sampling import sample_rows  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
VOCAB = 1500 if INTERPRET else 128256


def settings(rows, temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed0=0, step0=0):
    full = lambda v, dtype: torch.full((rows,), v, dtype=dtype, device=DEVICE)  # noqa: E731
    return dict(temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int32),
                top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
                seeds=torch.arange(seed0, seed0 + rows, dtype=torch.int64, device=DEVICE) * 7919 + 3,
                step_index=torch.full((rows,), step0, dtype=torch.int64, device=DEVICE))


def run_kernel(logits, s, **outputs):
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=DEVICE)
    sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"], out,
                **outputs)
    return out


# chunks of 128 logits (blocks of 64): a row of the test vocabulary in several chunks, also under the interpreter
SMALL_CHUNKS = dict(chunk=128, block=64)
ONE_CHUNK = dict(chunk=64 * triton.cdiv(VOCAB, 64), block=64)


def as_tensors(s, rows):
    ones, zeros = torch.ones(rows, device=DEVICE), torch.zeros(rows, device=DEVICE)
    return torch_sampler.SamplingTensors(
        temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"], min_p=s["min_p"], repetition_penalty=ones,
        presence_penalty=zeros, frequency_penalty=zeros, seeds=s["seeds"], step_index=s["step_index"],
        prompt_token_ids=None, output_token_ids=None, all_greedy=False, any_top_k=True, any_top_p=True,
        any_min_p=bool((s["min_p"] > 0).any()), any_penalty=False, num_logprobs=0)


def random_logits(rows, vocab=VOCAB, scale=3.0, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(dtype).to(DEVICE)


def test_greedy_rows_are_torch_argmax_bit_for_bit():
    logits = random_logits(8, scale=1.0)  # bf16 at this scale: many exact ties, the first one must win
    logits[3, 100:] = logits[3, 7]
    logits[5] = logits[5].max()
    got = run_kernel(logits, settings(8, temperature=0.0))
    assert got.tolist() == logits.float().argmax(-1).tolist()


def reference_masks(logits, s):
    """The torch sampler's kept tokens (sort-based top-k/top-p, then min-p), scaled logits z and its picks."""
    rows = logits.shape[0]
    z = logits.float() / s["temperature"].unsqueeze(1)
    kept = torch.isfinite(torch_sampler.apply_top_k_top_p(z, s["top_k"], s["top_p"]))
    probs = (z - z.amax(1, keepdim=True)).exp()
    kept &= probs >= s["min_p"].unsqueeze(1)
    return kept, torch_sampler.Sampler()(logits, as_tensors(s, rows)).token_ids


@pytest.mark.parametrize("top_k,top_p,min_p,scale", [(1, 1.0, 0.0, 3.0), (2, 1.0, 0.0, 3.0), (50, 1.0, 0.0, 3.0),
                                                     (333, 1.0, 0.0, 1.0), (0, 0.95, 0.0, 1.0), (0, 0.5, 0.0, 3.0),
                                                     (40, 0.9, 0.0, 3.0), (0, 0.1, 0.0, 0.5), (0, 1.0, 0.2, 2.0),
                                                     (20, 0.8, 0.05, 3.0)])
def test_picks_are_the_sorted_references(top_k, top_p, min_p, scale):
    """Every pick lies in the torch sampler's kept set (top-k ties included; top-p within rounding of its boundary),
    and is the torch sampler's own pick but for near-ties of the race that float rounding orders apart."""
    rows = 12 if INTERPRET else 256
    logits = random_logits(rows, scale=scale, seed=top_k * 7 + int(top_p * 100), dtype=torch.float32)
    s = settings(rows, temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p, step0=top_k)
    got = run_kernel(logits, s)
    kept, want = reference_masks(logits, s)
    inside = kept.gather(1, got.unsqueeze(1)).squeeze(1)
    if top_p == 1.0:
        assert inside.all()
    else:
        assert inside.float().mean().item() >= 0.99
    assert (got == want).float().mean().item() >= (0.9 if INTERPRET else 0.97)


def test_a_rows_draw_ignores_the_batch_around_it():
    rows = 12
    logits = random_logits(rows, seed=5)
    s = settings(rows, temperature=1.1, top_p=0.9, step0=4)
    s["top_k"][::3] = 20
    s["temperature"][1] = 0.0
    s["min_p"][2] = 0.05
    got = run_kernel(logits, s)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    shuffled = run_kernel(logits[order], {k: v[order] for k, v in s.items()})
    assert shuffled.tolist() == got[order].tolist()
    alone = run_kernel(logits[4:5], {k: v[4:5] for k, v in s.items()})
    assert alone.item() == got[4].item()


SLOW = pytest.mark.interpreter_slow  # ~0.1 s a draw under the interpreter: these run on the GPU (and on request)


@pytest.mark.parametrize("top_k,top_p,min_p,chunk", [(0, 1.0, 0.0, None), pytest.param(5, 1.0, 0.0, None, marks=SLOW),
                                                     pytest.param(0, 0.8, 0.0, None, marks=SLOW),
                                                     pytest.param(6, 0.7, 0.0, None, marks=SLOW),
                                                     pytest.param(0, 1.0, 0.3, None, marks=SLOW),
                                                     pytest.param(0, 0.8, 0.0, 4, marks=SLOW),
                                                     pytest.param(0, 1.0, 0.3, 4, marks=SLOW)])
def test_draws_follow_the_requested_distribution(top_k, top_p, min_p, chunk):
    """Chi-square over many rows of the same logits, each with its own seed: p-value above 1e-4 against the kept
    tokens' renormalised probabilities (tokens expected fewer than 5 times pooled in one bin), and no draw outside
    them. chunk=4: the 12-token rows in three chunks (the split passes)."""
    vocab, draws, temperature = 12, (300 if INTERPRET else 40000), 0.9
    base = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.0, -0.4, -0.9, -1.5, -3.0])
    logits = base.unsqueeze(0).expand(draws, vocab).contiguous().to(DEVICE)
    s = settings(draws, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, step0=9)
    out = torch.empty(draws, dtype=torch.int64, device=DEVICE)
    split = dict(chunk=chunk, block=chunk) if chunk else {}
    sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"], out,
                **split)
    counts = torch.bincount(out.cpu(), minlength=vocab).double()
    probs = (base.double() / temperature).softmax(0)
    kept = torch.ones(vocab, dtype=torch.bool)
    if top_k:
        kept[top_k:] = False
    if top_p < 1:
        renorm = torch.where(kept, probs, 0.0) / torch.where(kept, probs, 0.0).sum()
        kept &= (renorm.cumsum(0) - renorm) < top_p
    if min_p:
        kept &= probs >= min_p * probs.max()
    expected = torch.where(kept, probs, 0.0)
    expected = expected / expected.sum() * draws
    assert counts[~kept].sum() == 0
    big = kept & (expected >= 5)
    small = kept & ~big
    observed = torch.cat([counts[big], counts[small].sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[small].sum().reshape(1)])
    if not small.any():
        observed, wanted = observed[:-1], wanted[:-1]
    dof = observed.numel() - 1
    if dof == 0:
        return
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert p_value > 1e-4, (chi2, dof, counts.tolist(), expected.tolist())


def test_logprobs_ranks_and_lse_equal_log_softmax():
    rows = 10
    logits = random_logits(rows, seed=8)
    s = settings(rows, temperature=1.3, top_p=0.9)
    s["temperature"][0] = 0.0
    logprobs, lse = torch.empty(rows, device=DEVICE), torch.empty(rows, device=DEVICE)
    ranks = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    tokens = run_kernel(logits, s, logprobs=logprobs, ranks=ranks, lse=lse)
    raw = logits.float().log_softmax(-1)
    chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, chosen, rtol=0, atol=1e-4)
    torch.testing.assert_close(lse, logits.float().logsumexp(-1), rtol=0, atol=1e-4)
    assert ranks.tolist() == ((raw > chosen.unsqueeze(1)).sum(1) + 1).tolist()
    assert ranks[0].item() == 1


def test_bad_arguments_are_refused():
    logits = random_logits(2)
    s = settings(2)
    with pytest.raises(ValueError, match="out must be"):
        sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"],
                    torch.empty(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="go together"):
        run_kernel(logits, s, logprobs=torch.empty(2, device=DEVICE))


def mixed_settings(rows, seed0=0):
    """Greedy, temperature-only, top-p, min-p, top-k and top-k + top-p rows in turn."""
    s = settings(rows, temperature=0.9, seed0=seed0, step0=2)
    kind = torch.arange(rows, device=DEVICE) % 6
    s["temperature"][kind == 0] = 0.0
    s["top_p"][kind == 2] = 0.7
    s["min_p"][kind == 3] = 0.3
    s["top_k"][(kind == 4) | (kind == 5)] = 9
    s["top_p"][kind == 5] = 0.8
    return s, kind


def test_split_passes_draw_what_one_chunk_draws():
    """Chunks of 128 logits against the whole row in one chunk, on the same rows: greedy, temperature, min-p and
    top-k rows bit for bit; top-p rows too but for masses summed in another order at the nucleus's edge (under 3%)."""
    rows = 24 if INTERPRET else 600
    logits = random_logits(rows, scale=2.0, seed=11)
    s, kind = mixed_settings(rows)
    outs = []
    for split in (SMALL_CHUNKS, ONE_CHUNK):
        out = torch.empty(rows, dtype=torch.int64, device=DEVICE)
        sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"], out,
                    **split)
        outs.append(out)
    same = outs[0] == outs[1]
    exact = (kind != 2) & (kind != 5)
    assert same[exact].all(), (outs[0][exact & ~same].tolist(), outs[1][exact & ~same].tolist())
    assert same[~exact].float().mean().item() >= 0.97


def test_split_logprobs_equal_log_softmax():
    """Logprobs, ranks and the log-sum-exp from chunks of 128 logits (the rank counted chunk by chunk)."""
    rows = 10
    logits = random_logits(rows, seed=12)
    s, _ = mixed_settings(rows, seed0=3)
    logprobs, lse = torch.empty(rows, device=DEVICE), torch.empty(rows, device=DEVICE)
    ranks = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    tokens = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"], tokens,
                logprobs=logprobs, ranks=ranks, lse=lse, **SMALL_CHUNKS)
    raw = logits.float().log_softmax(-1)
    chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, chosen, rtol=0, atol=1e-4)
    torch.testing.assert_close(lse, logits.float().logsumexp(-1), rtol=0, atol=1e-4)
    assert ranks.tolist() == ((raw > chosen.unsqueeze(1)).sum(1) + 1).tolist()


def test_rows_still_open_after_the_split_reruns_finish_alike(monkeypatch):
    """A narrow nucleus (top-p 0.05 over flat logits) rejects most first winners: with no split rerun every such row
    finishes in the final kernel's loop, and draws what the split reruns draw."""
    rows = 8 if INTERPRET else 256
    logits = random_logits(rows, scale=0.5, seed=13)
    s = settings(rows, temperature=1.0, top_p=0.05, step0=7)
    outs = []
    for reruns in (triton_sampling.SPLIT_RERUNS, 0):
        monkeypatch.setattr(triton_sampling, "SPLIT_RERUNS", reruns)
        out = torch.empty(rows, dtype=torch.int64, device=DEVICE)
        sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"], out,
                    **SMALL_CHUNKS)
        outs.append(out)
    kept, _ = reference_masks(logits, s)
    for out in outs:
        assert kept.gather(1, out.unsqueeze(1)).float().mean().item() >= 0.9
    assert (outs[0] == outs[1]).float().mean().item() >= 0.9


def test_bad_chunks_are_refused():
    logits = random_logits(2)
    s = settings(2)
    with pytest.raises(ValueError, match="multiple of block"):
        sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"],
                    torch.empty(2, dtype=torch.int64, device=DEVICE), chunk=100, block=64)


def test_rows_without_top_k_draw_alike_without_its_passes():
    """any_top_k=False (steps where no row has top-k) leaves out the radix passes and draws the same tokens."""
    rows = 12
    logits = random_logits(rows, seed=14)
    s, kind = mixed_settings(rows, seed0=5)
    s["top_k"].zero_()
    outs = []
    for any_top_k in (True, False):
        out = torch.empty(rows, dtype=torch.int64, device=DEVICE)
        sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"], out,
                    any_top_k=any_top_k, **SMALL_CHUNKS)
        outs.append(out)
    assert outs[0].tolist() == outs[1].tolist()


@pytest.mark.parametrize("top_k_chunk", [None, pytest.param(64, marks=SLOW)])
def test_top_k_cutoffs_are_the_kth_largest_exactly(top_k_chunk):
    """Top-k's radix descent lands on the k-th largest z bit for bit (bf16 logits, so with ties), for k from 1 to
    V - 1 and any split of its histogram passes; its draws do not depend on that split."""
    rows = 8 if INTERPRET else 256
    logits = random_logits(rows, scale=2.0, seed=21)
    logits[1, :] = logits[1, 0]  # one value everywhere: every token ties with the cutoff
    s = settings(rows, temperature=1.0)  # z = x exactly, in the kernel and in torch
    ks = [1, 2, 50, VOCAB - 1, 333, 7, 999, 64, 3, 17]
    s["top_k"] = torch.tensor([ks[i % len(ks)] for i in range(rows)], dtype=torch.int32, device=DEVICE)
    cutoffs = torch.empty(rows, device=DEVICE)
    out = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"], out,
                top_k_cutoffs=cutoffs, top_k_chunk=top_k_chunk, **SMALL_CHUNKS)
    z = logits.float()
    want = torch.stack([z[r].topk(int(s["top_k"][r])).values[-1] for r in range(rows)])
    assert cutoffs.tolist() == want.tolist()
    assert (z.gather(1, out.unsqueeze(1)).squeeze(1) >= want).all()
    again = torch.empty_like(out)
    sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"], again,
                **SMALL_CHUNKS)
    assert again.tolist() == out.tolist()


def test_rows_without_top_k_report_no_cutoff():
    rows = 4
    logits = random_logits(rows, seed=22)
    s = settings(rows, temperature=1.0, top_k=0)  # z = x exactly, in the kernel and in torch
    s["top_k"][1] = 5
    s["temperature"][2] = 0.0
    s["top_k"][2] = 5  # greedy: no top-k
    cutoffs = torch.empty(rows, device=DEVICE)
    sample_rows(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["step_index"],
                torch.empty(rows, dtype=torch.int64, device=DEVICE), top_k_cutoffs=cutoffs, **SMALL_CHUNKS)
    assert cutoffs[[0, 2, 3]].tolist() == [float("-inf")] * 3
    assert cutoffs[1].item() == logits[1].float().topk(5).values[-1].item()
