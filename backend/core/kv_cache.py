"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, reference counts and prefix caching."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from backend.request import Request

NULL_BLOCK = 0  # never handed out: padding rows of a step write their K/V here


class BlockManager:
    """Hands out KV blocks to requests; full blocks are hashed so a repeated prefix is computed once."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # free blocks in eviction order (least recently freed first); cached blocks stay findable here
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.prefix_queries = 0  # full prompt blocks looked up
        self.prefix_hits = 0  # of them, found in the cache

    # ---- figures -------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request (cached-but-free blocks do not count)."""
        return self.num_usable_blocks - len(self.free_blocks)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---- allocation ----------------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_ids))

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make req's blocks cover its computed tokens plus num_new_tokens; False if blocks ran out."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            req.block_ids.append(self._take_free_block())
        return True

    def append_one_block_each(self, reqs: list[Request]) -> list[int] | None:
        """One more block for each of reqs (decode rows whose next token starts a block), in one pass; None,
        taking nothing, when fewer are free."""
        if len(reqs) > len(self.free_blocks):
            return None
        free, block_hash, hash_to_block, ref_counts = self.free_blocks, self.block_hash, self.hash_to_block, self.ref_counts
        blocks = []
        for req in reqs:  # _take_free_block, inlined: a few rows need a block every step
            block, _ = free.popitem(last=False)
            old = block_hash[block]
            if old is not None:  # evict its cached content
                if hash_to_block.get(old) == block:
                    del hash_to_block[old]
                block_hash[block] = None
            ref_counts[block] = 1
            req.block_ids.append(block)
            blocks.append(block)
        return blocks

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:  # evict its cached content
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def free(self, req: Request) -> None:
        """Return req's blocks; safe to call once per allocation (the flag guards double frees)."""
        if req.blocks_freed:
            return
        ref_counts, free_blocks = self.ref_counts, self.free_blocks  # a request holds up to hundreds of blocks
        # tail blocks first, so a shared prefix stays cached longest
        for block in reversed(req.block_ids):
            count = ref_counts[block] - 1
            ref_counts[block] = count
            if not count:
                free_blocks[block] = None
        req.block_ids = []
        req.block_hashes = []
        req.blocks_freed = True

    def release_tail(self, req: Request, keep: int) -> None:
        """Return req's blocks past its first `keep` (blocks a speculative step took for drafts it rejected: never
        hashed, held by req alone)."""
        ref_counts, free_blocks = self.ref_counts, self.free_blocks
        while len(req.block_ids) > keep:
            block = req.block_ids.pop()
            ref_counts[block] -= 1
            if not ref_counts[block]:
                free_blocks[block] = None

    def share_prompt(self, src: Request, dst: Request) -> None:
        """dst, another sample of src's prompt, takes src's full prompt blocks (whose KV src's queued steps write)
        as its own computed tokens; it computes the rest, at least the last prompt token, in blocks of its own."""
        shared = (src.num_prompt_tokens - 1) // self.block_size
        dst.block_ids = src.block_ids[:shared]
        dst.block_hashes = src.block_hashes[:shared]
        for block in dst.block_ids:
            self.ref_counts[block] += 1
        dst.blocks_freed = False
        dst.num_computed_tokens = dst.num_cached_tokens = shared * self.block_size

    # ---- prefix caching ------------------------------------------------------------------------
    def prepare_prompt(self, req: Request, like: Request | None = None) -> None:
        """Give req its prompt as an int64 array and its full prompt blocks' hashes (like: another sample of the
        same prompt, prepared already, whose are shared). Reads only the block size and req: callers' threads run it
        before the loop sees the request."""
        if like is not None:
            req.prompt_array, req.prompt_hashes = like.prompt_array, like.prompt_hashes
            return
        req.prompt_array = np.asarray(req.prompt_token_ids, dtype=np.int64)
        if self.enable_prefix_caching:
            self._prompt_hashes(req)

    def _prompt_hashes(self, req: Request) -> list[int]:
        """req's full prompt blocks' chained hashes: as prepared, or made (and kept) now."""
        prepared = req.prompt_hashes
        if prepared is None or prepared[0] != self.block_size:  # made now: built without it, or for another size
            prepared = req.prompt_hashes = (self.block_size, prompt_block_hashes(req.prompt_token_ids, self.block_size))
        return prepared[1]

    def match_prefix(self, req: Request) -> int:
        """Share cached blocks of req's prompt; returns the number of tokens they cover."""
        if not self.enable_prefix_caching or req.block_ids:
            return 0
        prompt_hashes = self._prompt_hashes(req)
        # the last prompt token is always computed, so its logits exist
        num_full = (req.num_prompt_tokens - 1) // self.block_size
        hashes: list[int] = []
        blocks: list[int] = []
        for i in range(num_full):
            h = prompt_hashes[i]
            self.prefix_queries += 1
            block = self.hash_to_block.get(h)
            if block is None:
                self.prefix_queries += num_full - i - 1
                break
            self.prefix_hits += 1
            hashes.append(h)
            blocks.append(block)
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        req.block_ids = blocks
        req.block_hashes = hashes
        req.blocks_freed = False
        req.num_cached_tokens = len(blocks) * self.block_size
        return req.num_cached_tokens

    def register_full_blocks(self, req: Request, num_known_computed: int) -> None:
        """Hash blocks whose tokens are all known and computed, so later requests can share them."""
        if not self.enable_prefix_caching or req.blocks_freed:
            return
        hashes, blocks, bs = req.block_hashes, req.block_ids, self.block_size
        prompt, outputs, n = req.prompt_token_ids, req.output_token_ids, req.num_prompt_tokens
        full = min(num_known_computed, n + len(outputs), len(blocks) * bs) // bs
        done = len(hashes)
        if full <= done:
            return
        prompt_full = min(full, n // bs)
        # prompt blocks: hashed already, where the request was made
        new = self._prompt_hashes(req)[done:prompt_full] if done < prompt_full else []
        # blocks holding outputs, hashed here; called for a few requests every step: the token slices are taken
        # here, not through Request.token_slice
        parent = new[-1] if new else hashes[-1] if done else 0
        for i in range(max(done, prompt_full), full):
            start, end = i * bs, i * bs + bs
            tokens = outputs[start - n:end - n] if start >= n else prompt[start:] + outputs[:end - n]
            parent = block_hash_of(parent, tokens)
            new.append(parent)
        hash_to_block, block_hash = self.hash_to_block, self.block_hash
        for block, h in zip(blocks[done:full], new):
            hashes.append(h)
            if h not in hash_to_block:
                hash_to_block[h] = block
                block_hash[block] = h


def block_hash_of(parent: int, tokens) -> int:
    """The prefix-cache hash of a full block of tokens whose preceding blocks hash to parent (0: the first block)."""
    return hash((parent, tuple(tokens)))


def prompt_block_hashes(tokens, block_size: int) -> list[int]:
    """The chained hash (block_hash_of) of each full block of a prompt, in order."""
    hashes, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash_of(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes
