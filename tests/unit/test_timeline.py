"""The timeline keeps a bounded window of spans; its summary and recent busy fraction count what they should."""
from backend.runtime.timeline import Timeline


def _record_steps(tl: Timeline, steps: int) -> None:
    for _ in range(steps):
        with tl.cpu_span("pack"):
            pass
        tl.gpu_begin("compute", None)
        tl.gpu_end("compute", None)
        tl.next_step()


def test_spans_are_bounded_and_the_oldest_drop_off():
    tl = Timeline(enabled=True, max_spans=50)
    _record_steps(tl, 100)
    assert len(tl.spans) == 50
    assert [s.step for s in tl.spans][:2] == [75, 75] and tl.spans[-1].step == 99


def test_summary_counts_every_recorded_step():
    tl = Timeline(enabled=True)
    _record_steps(tl, 300)
    assert tl.summary()["steps"] == 300


def test_recent_busy_fraction_is_the_union_of_gpu_spans_since_the_last_call():
    from backend.runtime.timeline import Span

    tl = Timeline(enabled=True)
    clock = [0.0]
    tl.now = lambda: clock[0]
    for start, end in [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]:  # union 3 s of 4
        tl._add_gpu_span(Span("gpu", "compute", start, end, 0))
    clock[0] = 4.0
    assert tl.recent_busy_fraction() == 0.75
    tl._add_gpu_span(Span("gpu", "compute", 4.0, 5.0, 1))
    clock[0] = 6.0
    assert tl.recent_busy_fraction() == 0.5


class _FakeEvent:
    """A CUDA timing event stand-in: done or not, recorded at t seconds after the anchor."""

    def __init__(self, t: float, done: bool = True):
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: "_FakeEvent") -> float:  # ms from this (the anchor) to other
        return (other.t - self.t) * 1e3


def test_gpu_spans_resolve_a_few_each_step_in_order_stopping_at_one_still_running():
    tl = Timeline(enabled=True)
    tl.use_cuda, tl._anchor = True, _FakeEvent(0.0)
    running = _FakeEvent(2.5, done=False)
    for item in [("h2d", _FakeEvent(0.0), _FakeEvent(0.5), 0), ("compute", _FakeEvent(0.5), _FakeEvent(2.0), 0),
                 ("compute", _FakeEvent(2.0), running, 1), ("d2h", _FakeEvent(2.5), _FakeEvent(2.6), 1)]:
        tl._pending_gpu.append(item)
    tl.next_step()  # step 1: nothing is two steps old yet
    assert not [s for s in tl.spans if s.row == "gpu"]
    tl.next_step()  # step 2: step 0's spans resolve; step 1's first span is still running, so it waits
    assert [(s.name, s.start, s.end) for s in tl.spans if s.row == "gpu"] == [("h2d", 0.0, 0.5),
                                                                             ("compute", 0.5, 2.0)]
    tl.next_step()
    assert len(tl._pending_gpu) == 2  # the running span holds back the one behind it
    running.done = True
    tl.next_step()
    assert not tl._pending_gpu and [s.name for s in tl.spans if s.row == "gpu"][-2:] == ["compute", "d2h"]


def test_engine_stats_carry_the_recent_gpu_busy_fraction_with_the_timeline_on(tmp_path):
    from backend import Engine, EngineConfig, SamplingParams
    from tests.tiny_models import build_tiny, random_prompts

    engine = Engine(EngineConfig(model=build_tiny("llama", str(tmp_path)), device="cpu", num_kv_blocks=96,
                                 block_size=4, max_num_seqs=4, max_num_batched_tokens=24, timeline=True))
    try:
        assert "gpu_busy_fraction" not in engine.stats()
        engine.generate(random_prompts([5], seed=3), SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        busy = engine.stats()["gpu_busy_fraction"]  # refreshed every 256 steps
        assert 0.0 < busy <= 1.0
    finally:
        engine.shutdown()


def test_union_length_counts_overlaps_once():
    from backend.runtime.timeline import union_length

    assert union_length([]) == 0.0
    assert union_length([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (6.0, 6.5)]) == 6.0  # [0, 4] and [5, 7]
