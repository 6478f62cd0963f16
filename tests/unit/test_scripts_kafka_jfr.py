"""scripts/kafka_jfr.py's summary of JFR execution samples (a measurement tool's pure part)."""

from __future__ import annotations

from scripts_module import load_script


def _load():
    return load_script("kafka_jfr")


def _sample(thread: str, *frames: tuple[str, str]) -> dict:
    return {"type": "jdk.ExecutionSample", "values": {
        "sampledThread": {"javaName": thread},
        "stackTrace": {"truncated": False, "frames": [
            {"method": {"type": {"name": cls}, "name": meth}} for cls, meth in frames]}}}


def test_summary_counts_threads_own_and_inclusive_frames_once_per_sample():
    kj = _load()
    events = [
        _sample("handler-0", ("a/B", "leaf"), ("a/C", "mid"), ("a/C", "mid"), ("java/lang/Thread", "run")),
        _sample("handler-0", ("a/C", "mid"), ("java/lang/Thread", "run")),
        _sample("network", ("a/D", "poll"), ("java/lang/Thread", "run")),
        _sample("network"),  # a sample without frames counts for its thread only
    ]
    threads, own, incl = kj.summarize(events)
    assert threads == {"handler-0": 2, "network": 2}
    assert own == [(25.0, "a.B.leaf"), (25.0, "a.C.mid"), (25.0, "a.D.poll")]
    # a recursive frame counts once per sample; the shares are of all samples
    assert dict((f, p) for p, f in incl) == {"java.lang.Thread.run": 75.0, "a.C.mid": 50.0, "a.B.leaf": 25.0,
                                             "a.D.poll": 25.0}


def test_summary_of_no_samples_is_empty():
    threads, own, incl = _load().summarize([])
    assert (dict(threads), own, incl) == ({}, [], [])
