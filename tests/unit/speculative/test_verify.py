"""Verifying drafts: the kept tokens are exactly the ones sampling alone would make, step after step (greedy and
seeded sampling), and a draft is kept with the probability the model gives it, at the first drafted position and at a
later one (chi-square tests)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.executor.sampler import Sampler
from backend.request import SamplingParams
from backend.speculative.speculator import StepDrafts
from backend.speculative.verify import expand_rows
from tests.sampling_helpers import sampling_tensors_from_params


def _tensors(params, seeds, steps, **kw):
    return sampling_tensors_from_params(params, seeds=seeds, step_indices=steps, device="cpu", **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_kept_tokens_are_the_ones_sampling_alone_makes(temperature):
    """Each of 6 rows drafts 4 tokens, some right, some wrong; the tokens the row emits equal those of sampling
    its positions one step at a time (the non-speculative path), for greedy and seeded sampled rows."""
    torch.manual_seed(0)
    rows, k, vocab = 6, 4, 50
    logits = torch.randn(rows, k + 1, vocab) * 3
    params = [SamplingParams(temperature=temperature, top_p=0.9, top_k=20) for _ in range(rows)]
    seeds, steps = [11 * r + 1 for r in range(rows)], [3 * r for r in range(rows)]
    sampler = Sampler()
    alone = torch.stack([torch.stack([sampler(logits[r, i:i + 1], _tensors(params[r:r + 1], [seeds[r]],
                                                                           [steps[r] + i])).token_ids[0]
                                      for i in range(k + 1)]) for r in range(rows)])
    drafts = alone[:, :k].clone()
    for r in range(rows):  # row r's draft goes wrong at position r (rows 4 and 5: every draft right)
        if r < k:
            drafts[r, r] = (drafts[r, r] + 1) % vocab
    expanded = expand_rows(_tensors(params, seeds, steps), k + 1)
    sampled = sampler(logits.reshape(rows * (k + 1), vocab), expanded).token_ids.reshape(rows, k + 1)
    assert torch.equal(sampled, alone)
    accepted = StepDrafts(drafts.tolist()).kept(sampled.reshape(-1).tolist())
    assert accepted == [0, 1, 2, 3, 4, 4]
    for r in range(rows):
        emitted = sampled[r, :accepted[r] + 1]
        assert torch.equal(emitted, alone[r, :accepted[r] + 1])


def test_a_draft_is_kept_with_the_probability_the_model_gives_it():
    """One position, vocabulary 6, a fixed distribution; 12,000 seeds. The draft (token 2) is kept as often as
    p(2) says, and the token emitted follows p whatever was drafted (chi-square, 5 degrees of freedom: 20.52 is
    its 0.999 quantile)."""
    probs = torch.tensor([0.05, 0.1, 0.3, 0.25, 0.2, 0.1])
    n = 12_000
    logits = probs.log().expand(n, 2, 6).reshape(2 * n, 6)
    params = [SamplingParams(temperature=1.0)] * n
    expanded = expand_rows(_tensors(params, list(range(n)), [0] * n), 2)
    sampled = Sampler()(logits, expanded).token_ids.reshape(n, 2)
    accepted = StepDrafts([[2]] * n).kept(sampled.reshape(-1).tolist())
    kept = np.mean(accepted)
    assert abs(kept - 0.3) < 4 * np.sqrt(0.3 * 0.7 / n)
    first = sampled[:, 0]  # the emitted token: the kept draft, or the model's own token in its place
    observed = torch.bincount(first, minlength=6).double()
    expected = probs.double() * n
    assert ((observed - expected) ** 2 / expected).sum().item() < 20.52


def test_a_later_draft_is_kept_with_the_probability_the_model_gives_it_there():
    """Two drafted positions, vocabulary 6, another distribution at each; 12,000 seeds. Among the rows whose first
    draft (token 1, p = 0.5) is kept, the second (token 2) is kept as often as position 2's p(2) says, and the token
    emitted there follows position 2's p (chi-square, 5 degrees of freedom: 20.52 is its 0.999 quantile)."""
    first_probs = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])
    probs = torch.tensor([0.05, 0.1, 0.3, 0.25, 0.2, 0.1])
    n = 12_000
    rest = torch.full((6,), 1 / 6)  # after the second draft: any distribution, never checked
    logits = torch.stack([first_probs, probs, rest]).log().expand(n, 3, 6).reshape(3 * n, 6)
    params = [SamplingParams(temperature=1.0)] * n
    expanded = expand_rows(_tensors(params, list(range(n)), [0] * n), 3)
    sampled = Sampler()(logits, expanded).token_ids.reshape(n, 3)
    accepted = np.array(StepDrafts([[1, 2]] * n).kept(sampled.reshape(-1).tolist()))
    after_first = accepted >= 1
    m = int(after_first.sum())
    assert abs(m / n - 0.5) < 4 * np.sqrt(0.5 * 0.5 / n)
    kept = np.mean(accepted[after_first] == 2)
    assert abs(kept - 0.3) < 4 * np.sqrt(0.3 * 0.7 / m)
    second = sampled[torch.from_numpy(after_first), 1]  # the kept second draft, or the model's token in its place
    observed = torch.bincount(second, minlength=6).double()
    expected = probs.double() * m
    assert ((observed - expected) ** 2 / expected).sum().item() < 20.52


def test_rows_with_penalties_count_the_drafts_before_each_position():
    params = [SamplingParams(temperature=1.0, repetition_penalty=1.2), SamplingParams(temperature=1.0)]
    st = _tensors(params, [1, 2], [0, 0], prompt_token_ids=[[1, 2], [4, -1]], output_token_ids=[[3, 9], [-1, -1]])
    out = expand_rows(st, [3, 2], drafts=[[7, 8], [5]])
    assert out.prompt_token_ids.tolist() == [[1, 2]] * 3 + [[4, -1]] * 2
    assert out.output_token_ids.tolist() == [[3, 9, -1, -1], [3, 9, 7, -1], [3, 9, 7, 8],
                                             [-1, -1, -1, -1], [-1, -1, 5, -1]]
    with pytest.raises(ValueError, match="penalties need their drafts"):
        expand_rows(st, 3)
    with pytest.raises(ValueError, match="penalties need their drafts"):
        expand_rows(st, [3, 2], drafts=[[7], [5]])


def test_rows_expand_to_their_own_counts():
    """Per-row counts: row r gets counts[r] rows, step indices step..step + counts[r] - 1; with the counts all
    equal it is the fixed expansion."""
    params = [SamplingParams(temperature=0.5, top_k=k) for k in (3, 5, 7)]
    st = _tensors(params, [10, 20, 30], [4, 0, 9])
    out = expand_rows(st, [2, 1, 3])
    assert out.step_index.tolist() == [4, 5, 0, 9, 10, 11]
    assert out.seeds.tolist() == [10, 10, 20, 30, 30, 30]
    assert out.top_k.tolist() == [3, 3, 5, 7, 7, 7]
    same = expand_rows(st, [2, 2, 2])
    fixed = expand_rows(st, 2)
    assert same.step_index.tolist() == fixed.step_index.tolist() and same.seeds.tolist() == fixed.seeds.tolist()
    with pytest.raises(ValueError):
        expand_rows(st, [2, 0, 1])
    with pytest.raises(ValueError):
        expand_rows(st, [2, 1])
