"""The output thread's batches: several steps of one request at once give one output, or stop exactly at a stop string."""
from __future__ import annotations

import queue

import pytest

from backend.models.random_model import EOS_ID as EOS, byte_tokenizer
from backend.outputs.processor import OutputProcessor, StepEvent
from backend.request import FINISH_LENGTH, FINISH_STOP, Request, SamplingParams


@pytest.fixture()
def tok():
    return byte_tokenizer()


def _run(tok, params: SamplingParams, batches: list[list[StepEvent]], stream: bool = True):
    stopped: list[str] = []
    processor = OutputProcessor(tok, stopped.append, lambda _rid: None)
    try:
        req = Request("r", tok.encode("hi", add_special_tokens=False), params, 0, frozenset({EOS}))
        sink: queue.SimpleQueue = queue.SimpleQueue()
        processor.register(req, sink, stream=stream)
        for batch in batches:
            processor._process(batch)  # what the thread does with the steps it found waiting
        outs = []
        while not sink.empty():
            outs.append(sink.get())
        return outs, stopped
    finally:
        processor.close()


def _events(ids, last_reason=None):
    return [StepEvent("r", t, None, last_reason if i == len(ids) - 1 else None) for i, t in enumerate(ids)]


def test_a_stop_string_ends_the_request_at_its_token_even_inside_one_batch(tok):
    ids = tok.encode("ab END cd", add_special_tokens=False)
    outs, stopped = _run(tok, SamplingParams(max_tokens=50, stop=["END"]), [_events(ids)])
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert outs[-1].finish_reason == FINISH_STOP and stopped == ["r"]
    assert outs[-1].token_ids == ids[:ids.index(ord("D")) + 1]  # nothing after the token that completed "END"
    assert "".join(o.delta_text for o in outs) == outs[-1].text == "ab "


def test_steps_waiting_together_become_one_output_with_all_their_tokens(tok):
    first, second = tok.encode("hello ", add_special_tokens=False), tok.encode("world", add_special_tokens=False)
    outs, _ = _run(tok, SamplingParams(max_tokens=len(first) + len(second)),
                   [_events(first), _events(second, FINISH_LENGTH)])
    assert [(o.delta_token_ids, o.delta_text, o.finished) for o in outs] == [
        (first, "hello ", False), (second, "world", True)]
    assert outs[-1].token_ids == first + second and outs[-1].finish_reason == FINISH_LENGTH


def test_eos_in_a_batch_joins_the_token_ids_but_not_the_text(tok):
    ids = tok.encode("ok", add_special_tokens=False) + [EOS]
    outs, _ = _run(tok, SamplingParams(max_tokens=10), [_events(ids, FINISH_STOP)])
    assert len(outs) == 1 and outs[0].finished and outs[0].delta_token_ids == ids and outs[0].text == "ok"


def test_a_token_that_completes_a_grammar_ends_the_request_and_stays_in_the_text(tok):
    """A constrained request ends with "stop" on the token that completes its grammar (no stop token): that token
    is text like the others."""
    ids = tok.encode('{"a":1}', add_special_tokens=False)
    outs, _ = _run(tok, SamplingParams(max_tokens=10), [_events(ids, FINISH_STOP)])
    assert outs[-1].finished and outs[-1].finish_reason == FINISH_STOP
    assert outs[-1].token_ids == ids and outs[-1].text == '{"a":1}'


def test_logprobs_of_a_batch_arrive_together(tok):
    ids = tok.encode("xyz", add_special_tokens=False)
    events = [StepEvent("r", t, (-0.5 * i, 1, None), FINISH_LENGTH if i == 2 else None) for i, t in enumerate(ids)]
    outs, _ = _run(tok, SamplingParams(max_tokens=3, logprobs=0), [events])
    assert len(outs) == 1 and [e["token_id"] for e in outs[0].delta_logprobs] == ids
    assert [e["logprob"] for e in outs[0].logprobs] == [0.0, -0.5, -1.0]


def test_coalesce_joins_a_requests_waiting_deltas_and_keeps_other_items_in_place():
    from backend.outputs.processor import coalesce_outputs
    from backend.request import RequestOutput

    def out(rid, ids, text, finished=False, lps=None):
        return RequestOutput(rid, [], "", list(ids), text, finished, "length" if finished else None,
                             delta_logprobs=lps)

    marker = object()
    a1, b1, a2 = out("a", [1], "x", lps=[{"token_id": 1}]), out("b", [7], "q"), out("a", [2, 3], "yz")
    a3 = out("a", [4], "!", finished=True, lps=[{"token_id": 4}])
    merged = coalesce_outputs([a1, b1, a2, marker, a3, out("a", [9], "late")])
    assert [m if m is marker else (m.request_id, m.delta_token_ids, m.delta_text) for m in merged] == [
        ("b", [7], "q"), ("a", [1, 2, 3], "xyz"), marker, ("a", [4], "!"), ("a", [9], "late")]
    assert merged[1].delta_logprobs == [{"token_id": 1}]
    # a finished output is never joined into a later one: its request has ended
    assert merged[3].finished and merged[3].delta_logprobs == [{"token_id": 4}]


def test_flush_returns_once_everything_pushed_before_it_reached_the_sink(tok):
    """flush: a consumer that learns the engine stopped can wait for the engine's last outputs (its error) to
    arrive before it answers the remaining requests itself. The output thread is held at its first batch, so
    the pushes queue up behind it; flush must not return before they and the final error are delivered."""
    import threading

    gate = threading.Event()
    processor = OutputProcessor(tok, lambda _rid: None, lambda _rid: None)
    real_process = processor._process

    def held_process(events):
        gate.wait(5)
        real_process(events)

    processor._process = held_process
    try:
        req = Request("r", tok.encode("hi", add_special_tokens=False), SamplingParams(max_tokens=50), 0, frozenset())
        sink: queue.SimpleQueue = queue.SimpleQueue()
        processor.register(req, sink)
        processor.push(_events(tok.encode("ab", add_special_tokens=False)))
        processor.push([StepEvent("r", None, None, "error", "injected fault")])
        assert processor.flush(timeout=0.2) is False  # held: not delivered yet
        assert sink.empty()
        gate.set()
        assert processor.flush(timeout=5) is True
        outs = []
        while not sink.empty():
            outs.append(sink.get())
        assert outs and outs[-1].finished and outs[-1].finish_reason == "error"
        assert outs[-1].error == "injected fault"
        assert [o.finished for o in outs].count(True) == 1
    finally:
        gate.set()
        processor.close()
