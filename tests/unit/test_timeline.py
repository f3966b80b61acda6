"""The timeline keeps a bounded window of spans, and its recent-window summary sees exactly the recent steps."""
from backend.timeline import Timeline


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


def test_recent_window_summary_counts_only_its_steps():
    tl = Timeline(enabled=True)
    _record_steps(tl, 300)
    assert tl.summary(since_step=tl.current_step - 256)["steps"] == 256
    assert tl.summary(since_step=290)["steps"] == 10
    assert tl.summary()["steps"] == 300
