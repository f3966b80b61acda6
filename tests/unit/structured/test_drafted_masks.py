"""TokenMasker.fill_drafted: a row's masks at its own token and after each of its drafts, each equal to the mask of
a fresh matcher fed the same drafts; the matchers left where they were; positions after a refused draft allow all."""
from __future__ import annotations

import torch

from tests.unit.structured.test_grammar import allowed, spec, vocab  # noqa: F401 (vocab: the fixture)


def _mask_after(vocab, constraint, tokens):  # noqa: F811 (the fixture's name)
    matcher = vocab.compiler.compile(constraint).matcher()
    for token in tokens:
        assert matcher.accept(token)
    return allowed(vocab.masker.fill([matcher])[0], vocab.vocab_size).clone()


def test_each_position_has_the_mask_after_the_drafts_before_it(vocab):  # noqa: F811
    regex = spec(regex=r"[A-Z][a-z]{2,6}-[0-9]{3}")
    choice = spec(choice=["red", "green", "blue"])
    bad = vocab.encode("gr") + vocab.encode("XX")  # a choice draft, then tokens the choice refuses
    matchers = [vocab.compiler.compile(regex).matcher(), None, vocab.compiler.compile(choice).matcher()]
    ahead = vocab.encode("Os")
    for token in ahead:  # the first row starts part-way through its text
        assert matchers[0].accept(token)
    drafts = [vocab.encode("lo-7"), [5, 6], bad]
    bitmask = vocab.masker.fill_drafted(matchers, drafts).clone()
    counts = [1 + len(d) for d in drafts]
    assert bitmask.shape[0] == sum(counts)
    rows = [allowed(bitmask[i], vocab.vocab_size) for i in range(sum(counts))]
    for i in range(counts[0]):  # every draft fits the regex: each position is the mask after the drafts before it
        assert torch.equal(rows[i], _mask_after(vocab, regex, ahead + drafts[0][:i]))
    assert all(rows[counts[0] + i].all() for i in range(counts[1]))  # no grammar: everything allowed
    first_bad = next(i for i in range(len(bad)) if not _mask_after(vocab, choice, bad[:i])[bad[i]])
    start = counts[0] + counts[1]
    for i in range(first_bad + 1):
        assert torch.equal(rows[start + i], _mask_after(vocab, choice, bad[:i]))
    for i in range(first_bad + 1, counts[2]):
        assert rows[start + i].all()  # after a refused draft: the draft is rejected before these positions
    # the matchers are back where they were: the next token's mask is the one before any draft
    assert torch.equal(allowed(vocab.masker.fill([matchers[0]])[0], vocab.vocab_size), rows[0])
    assert torch.equal(allowed(vocab.masker.fill([matchers[2]])[0], vocab.vocab_size), rows[start])
