"""From a caller's prompt and settings to the Requests of its samples, on the caller's thread: validated, ids
reserved, seeded, the prompt's KV blocks prepared, so the loop does none of it."""
from __future__ import annotations

import importlib.util
import itertools
import logging
import threading
from typing import Sequence

from backend.admission import Admission
from backend.config import EngineConfig
from backend.request import Request, SamplingParams
from backend.request_registry import RequestIds

log = logging.getLogger(__name__)


class RequestIntake:
    """Validates requests and builds their samples; thread-safe (the ids are reserved under RequestIds' lock)."""

    def __init__(self, config: EngineConfig, tokenizer, spec, max_model_len: int, block_manager):
        self.admission = Admission(tokenizer, spec.vocab_size, max_model_len, config,
                                   block_manager.num_usable_blocks * block_manager.block_size)
        self.ids = RequestIds(config.max_waiting_requests + config.max_num_seqs,
                              f"{config.max_waiting_requests} waiting + {config.max_num_seqs} running")
        self._seed = config.seed
        self._eos = frozenset(spec.eos_token_ids)
        self._blocks = block_manager
        self._counter = itertools.count()
        self._tokenizer = tokenizer
        self._vocab_size = spec.vocab_size
        self._grammars = None  # the GrammarCompiler, made for the first structured request
        self._grammars_lock = threading.Lock()

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._counter)}"

    def samples(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str,
                stream_outputs: bool) -> list[Request]:
        """The n samples of one request; the first holds the others as its forks (they join the scheduler with
        its prompt's KV blocks). ValueError for bad input or an id in use, EngineOverloaded when the queue is full."""
        token_ids = self.admission.prompt_ids(prompt, params)
        bad_words = self.admission.bad_word_ids(params.bad_words)
        grammar = self._compile(params)
        samples: list[Request] = []
        for index, sample_id in enumerate(self.ids.reserve(request_id, params.n)):
            if params.seed is not None:
                seed = params.seed + index  # samples of one seeded request differ, and repeat run to run
            else:
                seed = (self._seed * 1_000_003 + hash(sample_id)) & 0x7FFFFFFF
            req = Request(sample_id, token_ids, params, seed, self._eos, group_id=request_id, sample_index=index,
                          bad_word_ids=bad_words, grammar=grammar)
            req.final_only = not stream_outputs and not params.stop and params.logprobs is None
            self._blocks.prepare_prompt(req, like=samples[0] if samples else None)
            samples.append(req)
        samples[0].forks = samples[1:]
        return samples

    def prepare_grammars(self) -> threading.Thread | None:
        """Build the grammar library's view of the tokenizer now, on a helper thread, if the library is installed.
        It holds the GIL for about half a second on a 49k vocabulary (longer on larger ones): done when the first
        structured request arrives, it would stall every running stream that long."""
        if importlib.util.find_spec("llguidance") is None:
            return None
        thread = threading.Thread(target=self._warm_grammars, name="tandem-grammar-warmup", daemon=True)
        thread.start()
        return thread

    def _warm_grammars(self) -> None:
        try:
            self._grammar_compiler()
        except Exception as exc:  # a tokenizer the library cannot use: the first structured request is told why
            log.info("structured outputs not prepared at start-up: %s", exc)

    def _grammar_compiler(self):
        """The GrammarCompiler, made once (the grammar library loads on first use); ValueError if the tokenizer
        cannot be used."""
        with self._grammars_lock:
            if self._grammars is None:
                from backend.structured.grammar import GrammarCompiler

                eos = getattr(self._tokenizer, "eos_token_id", None)
                if eos not in self._eos:
                    eos = min(self._eos) if self._eos else None
                self._grammars = GrammarCompiler(self._tokenizer, self._vocab_size, eos)
            return self._grammars

    def _compile(self, params: SamplingParams):
        """The request's compiled output constraint (cached by its text), or None; ValueError naming what is wrong.
        Compiled here, on the caller's thread: the loop never waits for a grammar, and a request holds no seat
        while its grammar compiles."""
        if params.structured_outputs is None:
            return None
        return self._grammar_compiler().compile(params.structured_outputs)
