"""The timeline keeps a bounded window of spans; its summary and recent busy fraction count what they should: exact
GPU spans as busy, the wall only uncertain spans cover as the uncertain share."""
import importlib.util
import sys
import types
from pathlib import Path

from backend.runtime.timeline import Span, Timeline


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
        self.queries = 0

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def elapsed_time(self, other: "_FakeEvent") -> float:  # ms from this (the anchor) to other
        return (other.t - self.t) * 1e3


def test_gpu_spans_resolve_a_few_each_step_in_order_stopping_at_one_still_running():
    tl = Timeline(enabled=True)
    tl.use_cuda, tl._anchor = True, _FakeEvent(0.0)
    running = _FakeEvent(2.5, done=False)
    for item in [("h2d", _FakeEvent(0.0), _FakeEvent(0.5), 0, True, 0.0, False),
                 ("compute", _FakeEvent(0.5), _FakeEvent(2.0), 0, True, 0.0, True),
                 ("compute", _FakeEvent(2.0), running, 1, True, 0.0, True),
                 ("d2h", _FakeEvent(2.5), _FakeEvent(2.6), 1, True, 0.0, False)]:
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


def _cuda_timeline(events: list[_FakeEvent]) -> Timeline:
    """A timeline on the CUDA path whose events are the given stand-ins, handed out in order."""
    tl = Timeline(enabled=True)
    tl.use_cuda, tl._anchor = True, _FakeEvent(0.0)
    supply = iter(events)
    tl._event = lambda: next(supply)
    return tl


def test_a_span_whose_start_the_gpu_had_not_reached_when_its_end_was_queued_is_exact():
    # compute: start not yet executed at the end's record, so every kernel was queued ahead of the GPU -> exact
    # compute: start already executed, eager launches -> uncertain
    # compute: start already executed, but graph replays (gap_free) -> exact, and the event is not even asked
    queued, reached, replayed = _FakeEvent(0.0, done=False), _FakeEvent(2.0), _FakeEvent(4.0)
    tl = _cuda_timeline([queued, _FakeEvent(1.0), reached, _FakeEvent(3.0), replayed, _FakeEvent(4.5)])
    for gap_free in (False, False, True):
        tl.gpu_begin("compute", None)
        tl.gpu_end("compute", None, gap_free=gap_free)
    assert [item[4] for item in tl._pending_gpu] == [True, False, True]
    assert (queued.queries, reached.queries, replayed.queries) == (1, 1, 0)
    queued.done = True
    tl.resolve()
    assert [(s.start, s.end, s.exact) for s in tl.spans] == [(0.0, 1.0, True), (2.0, 3.0, False), (4.0, 4.5, True)]
    summary = tl.summary()  # wall 4.5 s: exact 1.5 s, uncertain 1 s
    assert summary["gpu_busy_fraction"] == 1.5 / 4.5
    assert summary["gpu_busy_uncertain_fraction"] == 1.0 / 4.5


def test_graph_replays_idle_is_left_out_of_busy_and_an_unmeasured_one_makes_the_span_uncertain():
    # three graph-replay spans of 1 s each: 0.25 s of measured inner idle, none, and idle not measured (None)
    events = [_FakeEvent(t) for t in (0.0, 1.0, 1.0, 2.0, 2.0, 3.0)]
    tl = _cuda_timeline(events)
    for idle in (0.25, 0.0, None):
        tl.gpu_begin("compute", None)
        tl.gpu_end("compute", None, gap_free=True, idle_s=idle)
    tl.resolve()
    assert [(s.exact, s.idle) for s in tl.spans] == [(True, 0.25), (True, 0.0), (False, 0.0)]
    summary = tl.summary()  # wall 3 s: busy 2 s of exact spans less 0.25 s idle; 1 s uncertain
    assert summary["gpu_busy_fraction"] == 1.75 / 3
    assert summary["gpu_busy_uncertain_fraction"] == 1.0 / 3


def test_recent_busy_fraction_leaves_out_idle_and_the_share_of_it_past_the_furthest_end():
    tl = Timeline(enabled=True)
    clock = [0.0]
    tl.now = lambda: clock[0]
    tl._add_gpu_span(Span("gpu", "compute", 0.0, 2.0, 0, True, 0.5))  # 1.5 s busy
    tl._add_gpu_span(Span("gpu", "compute", 1.0, 3.0, 0, True, 0.4))  # half of it is new: 1 s less 0.2 s idle
    clock[0] = 4.0
    assert abs(tl.recent_busy_fraction() - 2.3 / 4) < 1e-12
    assert tl.recent_uncertain_fraction() == 0.0


def test_summary_counts_exact_spans_as_busy_and_the_wall_only_uncertain_spans_cover_as_uncertain():
    tl = Timeline(enabled=True)
    tl.spans.append(Span("cpu", "schedule", 0.0, 8.0, 0))  # the wall: 8 s
    for start, end, exact in [(0.0, 2.0, True), (1.0, 3.0, True), (2.5, 5.0, False), (6.0, 7.0, False),
                              (6.5, 8.0, True)]:
        tl._add_gpu_span(Span("gpu", "compute", start, end, 0, exact))
    summary = tl.summary()
    # exact: [0, 3] and [6.5, 8] = 4.5 s; every span: [0, 5] and [6, 8] = 7 s, so 2.5 s are uncertain only
    assert summary["gpu_busy_fraction"] == 4.5 / 8
    assert summary["gpu_busy_uncertain_fraction"] == 2.5 / 8


def test_cpu_timeline_spans_are_exact_so_nothing_is_uncertain():
    tl = Timeline(enabled=True)
    _record_steps(tl, 20)
    assert all(s.exact for s in tl.spans if s.row == "gpu")
    assert tl.summary()["gpu_busy_uncertain_fraction"] == 0.0
    tl.recent_busy_fraction()
    assert tl.recent_uncertain_fraction() == 0.0
    assert Timeline().summary()["gpu_busy_uncertain_fraction"] == 0.0  # nothing recorded


def test_recent_busy_fraction_counts_exact_spans_and_the_uncertain_share_the_rest_of_the_same_window():
    tl = Timeline(enabled=True)
    clock = [0.0]
    tl.now = lambda: clock[0]
    tl._add_gpu_span(Span("gpu", "compute", 0.0, 1.0, 0, True))
    tl._add_gpu_span(Span("gpu", "compute", 0.5, 2.0, 0, False))  # 1 s past the exact span
    clock[0] = 4.0
    assert tl.recent_busy_fraction() == 0.25
    assert tl.recent_uncertain_fraction() == 0.25
    tl._add_gpu_span(Span("gpu", "compute", 4.0, 5.0, 1, False))
    tl._add_gpu_span(Span("gpu", "compute", 4.5, 5.5, 1, True))  # covers 4.5-5.5: [4, 4.5] is uncertain only
    clock[0] = 6.0
    assert tl.recent_busy_fraction() == 0.5
    assert tl.recent_uncertain_fraction() == 0.25
    assert tl.recent_uncertain_fraction() == 0.25  # asking again keeps the window
    clock[0] = 8.0
    assert tl.recent_busy_fraction() == 0.0 and tl.recent_uncertain_fraction() == 0.0  # an idle window
    tl.enable()  # a fresh window: the running totals start over
    assert tl.recent_uncertain_fraction() == 0.0 and tl._covered.total == 0.0


def test_engine_stats_carry_the_recent_gpu_busy_fraction_with_the_timeline_on(tmp_path):
    from backend import Engine, EngineConfig, SamplingParams
    from tests.tiny_models import build_tiny, random_prompts

    engine = Engine(EngineConfig(model=build_tiny("llama", str(tmp_path)), device="cpu", num_kv_blocks=96,
                                 block_size=4, max_num_seqs=4, max_num_batched_tokens=24, timeline=True))
    try:
        assert "gpu_busy_fraction" not in engine.stats()
        engine.generate(random_prompts([5], seed=3), SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        stats = engine.stats()  # refreshed every 256 steps
        assert 0.0 < stats["gpu_busy_fraction"] <= 1.0
        assert stats["gpu_busy_uncertain_fraction"] == 0.0  # the CPU runs its spans' work synchronously: all exact
    finally:
        engine.shutdown()
    # with the loop stopped, a refresh over spans of known length: every 256th step reads the timeline, the steps
    # between keep its figures
    tl = engine.timeline
    tl.enable()
    clock = [0.0]
    tl.now = lambda: clock[0]
    tl.recent_busy_fraction()
    tl._add_gpu_span(Span("gpu", "compute", 0.0, 1.0, 0, True))
    tl._add_gpu_span(Span("gpu", "compute", 1.0, 3.0, 0, False))
    clock[0] = 8.0
    engine.loop.steps = 512
    engine.loop.refresh_stats()
    assert (engine.stats()["gpu_busy_fraction"], engine.stats()["gpu_busy_uncertain_fraction"]) == (0.125, 0.25)
    tl._add_gpu_span(Span("gpu", "compute", 8.0, 9.0, 1, False))
    clock[0] = 10.0
    engine.loop.steps = 513
    engine.loop.refresh_stats()
    assert (engine.stats()["gpu_busy_fraction"], engine.stats()["gpu_busy_uncertain_fraction"]) == (0.125, 0.25)


class _FakeMetric:
    """A Triton metric stand-in that keeps the last value set."""

    def __init__(self, family: "_FakeFamily", labels: dict) -> None:
        self.family, self.labels, self.value = family, labels, None

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value = (self.value or 0.0) + value


class _FakeFamily:
    """A Triton metric family stand-in: every family made is listed on the class."""

    COUNTER, GAUGE = "counter", "gauge"
    made: list["_FakeFamily"] = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind, self.metrics = name, description, kind, []
        _FakeFamily.made.append(self)

    def Metric(self, labels: dict) -> _FakeMetric:  # noqa: N802 (Triton's name)
        metric = _FakeMetric(self, labels)
        self.metrics.append(metric)
        return metric


def test_the_uncertain_share_is_its_own_gauge_beside_gpu_busy(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(MetricFamily=_FakeFamily))
    monkeypatch.setattr(_FakeFamily, "made", [])
    path = Path(__file__).resolve().parents[3] / "model_repository" / "llm" / "1" / "metrics.py"
    spec = importlib.util.spec_from_file_location("serving_metrics_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    metrics = module.ServingMetrics("llm", "1", "llm_0")
    gauges = {f.name: f for f in _FakeFamily.made if f.kind == "gauge"}
    assert "tandem_gpu_busy_uncertain_ratio" in gauges and "tandem_gpu_busy_ratio" in gauges
    metrics.update_engine({"gpu_busy_fraction": 0.625, "gpu_busy_uncertain_fraction": 0.25})
    value = lambda name: [m.value for m in gauges[name].metrics]  # noqa: E731
    assert value("tandem_gpu_busy_ratio") == [0.625] and value("tandem_gpu_busy_uncertain_ratio") == [0.25]
    assert gauges["tandem_gpu_busy_uncertain_ratio"].metrics[0].labels == {"model": "llm", "version": "1",
                                                                           "instance": "llm_0"}
    metrics.update_engine({})  # the timeline off: no figures yet
    assert value("tandem_gpu_busy_ratio") == [0.0] and value("tandem_gpu_busy_uncertain_ratio") == [0.0]


def test_union_length_counts_overlaps_once():
    from backend.runtime.timeline import union_length

    assert union_length([]) == 0.0
    assert union_length([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (6.0, 6.5)]) == 6.0  # [0, 4] and [5, 7]


class _SpyTimeline(Timeline):
    """A CPU timeline that also lists each gpu_end's (name, gap_free, idle_s)."""

    def __init__(self) -> None:
        super().__init__(enabled=True)
        self.ends: list[tuple[str, bool, float | None]] = []

    def gpu_end(self, name: str, stream, gap_free: bool = False, idle_s: float | None = 0.0) -> None:
        self.ends.append((name, gap_free, idle_s))
        super().gpu_end(name, stream, gap_free, idle_s)


def test_the_pipeline_marks_graph_replays_and_lone_copies_gap_free_and_passes_the_graphs_idle_on():
    """The compute span is gap-free when the forward and the sampling were both graph replays (or nothing) queued one
    after the other, with the idle of both inside; host work between the two launches (deferred) makes it
    gap-uncertain."""
    import torch

    from backend.executor.pipeline import Pipeline, SlotLayout

    tl = _SpyTimeline()
    pipe = Pipeline(SlotLayout(max_tokens=8, max_seqs=4, max_blocks=2, max_logprobs=2), torch.device("cpu"), tl)
    cases = [  # (forward: replay, idle), (sampling: replay, idle), read_logprobs, deferred
        ((True, 0.5), (True, 0.25), False, False), ((True, 2e-5), (False, 0.0), False, False),
        ((True, None), (True, 0.0), True, False), ((True, 2e-5), (True, 0.0), False, True)]
    for forward, sampling, read_logprobs, deferred in cases:
        slot = pipe.acquire_slot()
        pipe.launch_forward(slot, slot.host_i32.numel(), lambda: forward)
        pipe.launch_sampling(slot, lambda: (2, *sampling), read_logprobs, deferred)
        pipe.wait(slot)
    assert tl.ends == [("h2d", True, 0.0), ("compute", True, 0.75), ("d2h", True, 0.0),
                       ("h2d", True, 0.0), ("compute", False, 0.0), ("d2h", True, 0.0),
                       ("h2d", True, 0.0), ("compute", True, None), ("d2h", False, 0.0),
                       ("h2d", True, 0.0), ("compute", False, 0.0), ("d2h", True, 0.0)]


def test_the_anchor_is_placed_again_until_the_clock_reads_bracket_it_closely():
    """A clock read held up after the anchor's wait (another thread holding Python's lock) would shift every GPU span
    late: the origin comes from the first placement whose two clock reads lie within the bracket."""
    from backend.runtime.timeline import anchored_origin

    reads = iter([0.0, 3.0, 3.0, 5.0, 10.0, 10.001, 20.0, 20.0])  # held up 3 s, then 2 s, then a close bracket
    placed = []
    origin = anchored_origin(lambda: placed.append(1), lambda: next(reads), bracket_s=0.002, tries=5)
    assert origin == 10.001 and len(placed) == 3
    reads = iter([0.0, 1.0, 2.0, 3.0])  # never close: the last try stands
    assert anchored_origin(lambda: None, lambda: next(reads), bracket_s=0.002, tries=2) == 3.0


def test_idle_polls_of_the_loop_record_no_spans(tmp_path):
    """While nothing runs the loop polls its inbox every half second; those polls are not steps, so the timeline's
    window (and the busy figures over it) ends with the last step, however long the engine then sits idle."""
    import time

    from backend import Engine, EngineConfig, SamplingParams
    from tests.tiny_models import build_tiny, random_prompts

    engine = Engine(EngineConfig(model=build_tiny("llama", str(tmp_path)), device="cpu", num_kv_blocks=96,
                                 block_size=4, max_num_seqs=4, max_num_batched_tokens=24, timeline=True))
    try:
        engine.generate(random_prompts([5, 7], seed=3), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        last_end = max(s.end for s in engine.timeline.spans)
        time.sleep(1.3)  # two idle polls or more
        spans = list(engine.timeline.spans)
    finally:
        engine.shutdown()
    names = [s.name for s in spans]
    assert names.count("schedule") == names.count("pack") > 0
    assert max(s.end for s in spans) == last_end


def test_copy_spans_are_recorded_only_when_asked_and_never_count_as_busy():
    """A step's host-to-device and device-to-host copies are no kernel time: GPU busy is the kernels' share."""
    for copy_spans in (False, True):
        events = [_FakeEvent(t) for t in (0.0, 1.0, 1.0, 2.0, 2.0, 4.0)]  # h2d 0-1, compute 1-2, d2h 2-4
        tl = _cuda_timeline(events)
        tl.copy_spans = copy_spans
        for name, copy in (("h2d", True), ("compute", False), ("d2h", True)):
            tl.gpu_begin(name, None, copy=copy)
            tl.gpu_end(name, None, gap_free=True)
        tl.resolve()
        assert [(s.name, s.kernels) for s in tl.spans] == (
            [("h2d", False), ("compute", True), ("d2h", False)] if copy_spans else [("compute", True)])
        summary = tl.summary()
        wall = 4.0 if copy_spans else 1.0  # the window runs from the first span to the last
        assert summary["gpu_busy_fraction"] == 1.0 / wall and summary["gpu_busy_uncertain_fraction"] == 0.0
        tl._mark = (0.0, 0.0, 0.0)
        tl.now = lambda: 4.0
        assert tl.recent_busy_fraction() == 0.25  # the running union: compute's 1 s of the 4 s since the mark
