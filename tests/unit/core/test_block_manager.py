"""BlockManager's prefix-cache hashing: each full block's hash chains its parent's with its own tokens, whichever
of the prompt and the outputs they come from, and whether the blocks are registered one at a time or at once."""
from __future__ import annotations

import random

from backend.core.kv_cache import BlockManager
from backend.request import Request, SamplingParams


def chain(tokens: list[int], block_size: int) -> list[int]:
    hashes, parent = [], 0
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


def test_full_blocks_hash_as_one_chain_over_prompt_and_outputs():
    rng = random.Random(0)
    bs = 16
    for prompt_len in (5, 16, 37, 48):
        outputs = [rng.randrange(1000) for _ in range(90)]
        at_once, one_by_one = BlockManager(64, bs), BlockManager(64, bs)
        reqs = []
        for bm in (at_once, one_by_one):
            req = Request("r", [rng.randrange(1000) for _ in range(prompt_len)] if not reqs else
                          list(reqs[0].prompt_token_ids), SamplingParams(max_tokens=200), 0, frozenset())
            assert bm.allocate_slots(req, prompt_len + len(outputs))
            reqs.append(req)
        a, b = reqs
        a.output_token_ids.extend(outputs)
        at_once.register_full_blocks(a, prompt_len + len(outputs))
        for tok in outputs:  # a token at a time, as steps deliver them; KV computed one token behind
            b.output_token_ids.append(tok)
            one_by_one.register_full_blocks(b, b.num_prompt_tokens + len(b.output_token_ids) - 1)
        want = chain(a.prompt_token_ids + outputs, bs)
        assert a.block_hashes == want
        assert b.block_hashes == want[:(prompt_len + len(outputs) - 1) // bs]
        assert [at_once.hash_to_block[h] for h in want] == a.block_ids[:len(want)]


def test_prompts_prepared_where_requests_are_made_hash_and_match_as_the_loop_would():
    """prepare_prompt (the caller's thread) hashes a prompt's full blocks ahead: registering its blocks gives the chain
    the loop would make itself, a later request finds them, prepared or not; hashes prepared for another block size
    are made again; another sample shares the prepared prompt."""
    import numpy as np

    rng = random.Random(1)
    bs = 16
    for prompt_len in (5, 16, 37, 48):
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        outputs = [rng.randrange(1000) for _ in range(40)]
        bm = BlockManager(64, bs)
        req = Request("r", list(prompt), SamplingParams(max_tokens=200), 0, frozenset())
        bm.prepare_prompt(req)
        assert req.prompt_hashes == (bs, chain(prompt, bs))
        np.testing.assert_array_equal(req.prompt_array, prompt)
        assert req.prompt_array.dtype == np.int64
        assert bm.allocate_slots(req, prompt_len + len(outputs))
        bm.register_full_blocks(req, prompt_len)
        for tok in outputs:
            req.output_token_ids.append(tok)
            bm.register_full_blocks(req, prompt_len + len(req.output_token_ids) - 1)
        assert req.block_hashes == chain(prompt + outputs, bs)[:(prompt_len + len(outputs) - 1) // bs]
        for prepared in (False, True):  # a later request with the same prompt shares its full blocks but the last
            later = Request("later", list(prompt), SamplingParams(max_tokens=5), 0, frozenset())
            if prepared:
                bm.prepare_prompt(later)
            assert bm.match_prefix(later) == (prompt_len - 1) // bs * bs
            assert later.block_ids == req.block_ids[:(prompt_len - 1) // bs]
            bm.free(later)
        sample = Request("r#1", req.prompt_token_ids, SamplingParams(max_tokens=5), 1, frozenset())
        bm.prepare_prompt(sample, like=req)
        assert sample.prompt_array is req.prompt_array and sample.prompt_hashes is req.prompt_hashes
    other = BlockManager(64, 4)  # prepared for blocks of 16: made again for blocks of 4
    other_req = Request("o", list(prompt), SamplingParams(max_tokens=5), 0, frozenset())
    bm.prepare_prompt(other_req)
    assert other.allocate_slots(other_req, len(prompt))
    other.register_full_blocks(other_req, len(prompt))
    assert other_req.block_hashes == chain(prompt, 4) and other_req.prompt_hashes == (4, chain(prompt, 4))
    off = BlockManager(64, bs, enable_prefix_caching=False)
    plain = Request("p", list(prompt), SamplingParams(max_tokens=5), 0, frozenset())
    off.prepare_prompt(plain)
    assert plain.prompt_hashes is None and plain.prompt_array is not None  # nothing hashed without prefix caching


def test_known_tokens_and_held_blocks_bound_the_hashing():
    bm = BlockManager(64, 16)
    req = Request("r", list(range(40)), SamplingParams(max_tokens=100), 0, frozenset())
    assert bm.allocate_slots(req, 40)  # 3 blocks: 48 slots
    bm.register_full_blocks(req, 1000)  # 40 known tokens: 2 full blocks
    assert len(req.block_hashes) == 2
    req.output_token_ids.extend(range(40, 60))  # 60 known, but 3 blocks held: 3 full blocks at most
    bm.register_full_blocks(req, 1000)
    assert req.block_hashes == chain(list(range(60)), 16)[:3]


def test_one_block_each_takes_blocks_as_allocate_slots_would():
    """append_one_block_each gives each request the block allocate_slots would give it, evicting cached content the
    same way; with fewer free blocks than requests it takes none."""
    bs = 4
    together, apart = BlockManager(12, bs), BlockManager(12, bs)
    for bm in (together, apart):  # a finished request leaves cached blocks behind: the next takers evict them
        old = Request("old", list(range(12)), SamplingParams(max_tokens=4), 0, frozenset())
        assert bm.allocate_slots(old, 12)
        bm.register_full_blocks(old, 12)
        bm.free(old)
    reqs = {id(bm): [Request(f"r{i}", [7] * (4 + i), SamplingParams(max_tokens=8), 0, frozenset()) for i in range(4)]
            for bm in (together, apart)}
    for bm in (together, apart):
        for req in reqs[id(bm)]:
            assert bm.allocate_slots(req, req.num_prompt_tokens)
            req.num_computed_tokens = len(req.block_ids) * bs  # every row's next token starts a block
    got = together.append_one_block_each(reqs[id(together)])
    for req in reqs[id(apart)]:
        assert apart.allocate_slots(req, 1)
    assert got == [r.block_ids[-1] for r in reqs[id(together)]]
    assert [r.block_ids for r in reqs[id(together)]] == [r.block_ids for r in reqs[id(apart)]]
    assert together.ref_counts == apart.ref_counts and together.block_hash == apart.block_hash
    assert together.hash_to_block == apart.hash_to_block and list(together.free_blocks) == list(apart.free_blocks)
    free_before = list(together.free_blocks)
    many = [Request(f"m{i}", [1], SamplingParams(max_tokens=8), 0, frozenset()) for i in range(len(free_before) + 1)]
    assert together.append_one_block_each(many) is None
    assert list(together.free_blocks) == free_before and not any(r.block_ids for r in many)


def _running(bm: BlockManager, prompt: list[int], outputs: list[int]) -> Request:
    """A running request whose prompt and outputs so far are computed, but its last output (fed next step)."""
    req = Request("r", list(prompt), SamplingParams(max_tokens=100), 0, frozenset())
    req.output_token_ids.extend(outputs)
    req.num_tokens = len(prompt) + len(outputs)
    req.num_computed_tokens = req.num_tokens - 1
    assert bm.allocate_slots(req, 0)
    return req


def test_a_request_hashes_its_output_blocks_when_it_finishes_or_is_preempted():
    """Output blocks are hashed once the request leaves the running set: when it finishes (a later prompt repeating
    prompt + output then finds them) and when it is preempted (its recompute finds them); the block whose KV
    waits for the last output token is not hashed. Before that only the prompt's blocks are (by the step update)."""
    from backend.core.scheduler import Scheduler
    from backend.core.step_update import StepUpdater
    from backend.request import RequestStatus

    bs, prompt, outputs = 4, list(range(100, 110)), list(range(200, 209))  # 10 + 9 tokens, 18 computed: 4 blocks
    for leave in ("finish", "preempt"):
        bm = BlockManager(32, bs)
        scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
        req = _running(bm, prompt, outputs)
        req.status = RequestStatus.RUNNING
        scheduler.running[req] = None
        bm.register_full_blocks(req, req.num_prompt_tokens)  # what the step update hashes: the prompt's 2 blocks
        assert len(req.block_hashes) == 2
        if leave == "finish":
            StepUpdater(scheduler, bm, 64).finish(req, "length", None)
        else:
            scheduler._preempt(req)
            assert scheduler.waiting[0] is req and req.num_computed_tokens == 0
        follow_up = Request("f", prompt + outputs + [7, 7], SamplingParams(max_tokens=4), 0, frozenset())
        assert bm.match_prefix(follow_up) == 4 * bs  # 18 tokens had KV: 4 full blocks
        assert follow_up.block_hashes == chain(prompt + outputs, bs)[:4]
