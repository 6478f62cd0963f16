"""bench.procmon's JIT-settle rule and the /proc parsing behind it (pure: fed stat lines and times)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.procmon import (  # noqa: E402
    JitSettle, ProcMonitor, compiler_ticks, stat_ticks, stat_user_system, thread_cpu_pct, thread_stats)

pytestmark = pytest.mark.unit


def stat(tid: int, comm: str, utime: int, stime: int) -> str:
    """A /proc/<pid>/task/<tid>/stat line: utime and stime are fields 14 and 15."""
    fields = ["S", "1", "1", "1", "0", "-1", "4194368", "10", "0", "0", "0", str(utime), str(stime), "0", "0"]
    return f"{tid} ({comm}) " + " ".join(fields) + " 20 0 30 0\n"


def test_compiler_ticks_counts_only_the_jit_compiler_threads():
    lines = [
        stat(100, "java", 500, 20),
        stat(101, "C2 CompilerThre", 1500, 30),
        stat(102, "C1 CompilerThre", 200, 5),
        stat(103, "data-plane-kafk", 900, 40),
        stat(104, "a (weird) name)", 7, 7),  # comm may hold spaces and parentheses
    ]
    assert compiler_ticks(lines) == 1500 + 30 + 200 + 5
    assert compiler_ticks([stat(1, "python3", 10, 10)]) == 0
    assert compiler_ticks(["garbage"]) == 0


def test_jit_settles_once_a_whole_chunk_is_quiet():
    s = JitSettle(max_pct=3.0, min_chunk_s=5.0)
    assert s.feed(0.0, 100.0) is False            # the first point only starts a chunk
    assert s.feed(16.0, 125.0) is False           # 16 s of compiling in 25 s: 64 % of a core
    assert round(s.last_pct) == 64
    assert s.feed(17.0, 135.0) is False           # 10 % in the next chunk
    assert s.feed(17.2, 145.0) is True            # 2 %: settled
    assert round(s.last_pct, 1) == 2.0


def test_with_two_quiet_chunks_asked_a_lull_between_bursts_is_not_settled():
    s = JitSettle(max_pct=3.0, min_chunk_s=5.0, quiet_chunks=2)
    s.feed(0.0, 0.0)
    assert s.feed(0.2, 10.0) is False             # 2 %: one quiet chunk, a lull maybe
    assert s.feed(1.2, 20.0) is False             # 10 %: a burst, so counting starts again
    assert s.feed(1.3, 30.0) is False             # 1 %
    assert s.feed(1.5, 40.0) is True              # 2 %: the second quiet chunk in a row


def test_a_chunk_too_short_to_judge_is_measured_on():
    s = JitSettle(max_pct=3.0, min_chunk_s=5.0)
    s.feed(10.0, 0.0)
    assert s.feed(10.0, 2.0) is False             # 2 s: too short, even though nothing was compiled
    assert s.last_pct is None
    assert s.feed(10.1, 6.0) is True              # 0.1 s over the 6 s since the start of the chunk


# -- ProcMonitor's cpu speed probe -----------------------------------------------------------------------------

def test_speed_between_takes_the_median_per_cpu_inside_the_window():
    mon = ProcMonitor()
    mon._speed = [(1.0, 0, 400.0), (2.0, 0, 800.0), (3.0, 0, 420.0), (2.5, 1, 700.0), (10.0, 1, 1.0)]
    assert mon.speed_between(0.5, 5.0) == {"0": 420.0, "1": 700.0}
    assert mon.speed_between(9.0, 11.0) == {"1": 1.0}
    assert ProcMonitor().speed_between(0.0, 1e9) == {}  # no probe, no figures


def test_the_probe_visits_every_cpu_and_moves_only_its_own_thread():
    before = os.sched_getaffinity(0)
    mon = ProcMonitor(probe_speed=True)
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: [mon._probe() for _ in range(2 * len(before))])
    t.start()
    t.join()
    speed = mon.speed_between(t0, time.monotonic())
    assert sorted(int(c) for c in speed) == sorted(before) and all(v > 0 for v in speed.values())
    assert os.sched_getaffinity(0) == before


def test_thread_cpu_pct_names_the_main_thread_sums_by_name_and_sorts_busiest_first():
    before = {40: ("python3.11", 100), 41: ("grpc_global_tim", 10), 42: ("grpc_global_tim", 5),
              43: ("ended", 50)}
    after = {40: ("python3.11", 100 + 250), 41: ("grpc_global_tim", 10 + 6), 42: ("grpc_global_tim", 5 + 4),
             44: ("new thread", 30)}
    # 10 s at 100 ticks/s: 250 ticks = 25 % of a core
    assert thread_cpu_pct(40, before, after, 10.0, 100) == [
        ("main", 25.0), ("new thread", 3.0), ("grpc_global_tim", 1.0)]
    assert thread_cpu_pct(40, before, after, 0.0, 100) == []
    # 30 s at 100 ticks/s: 4 ticks = 0.1333 % of a core (0.1 at the default one decimal)
    assert thread_cpu_pct(40, {40: ("x", 0)}, {40: ("x", 4)}, 30.0, 100) == [("main", 0.1)]
    assert thread_cpu_pct(40, {40: ("x", 0)}, {40: ("x", 4)}, 30.0, 100, digits=2) == [("main", 0.13)]


def test_thread_stats_reads_this_process():
    own = thread_stats(os.getpid())
    assert os.getpid() in own and own[os.getpid()][1] >= 0
    assert thread_stats(2 ** 22 + 12345) == {}  # no such process


def test_stat_user_system_reads_fields_14_and_15_after_a_comm_with_spaces_and_parentheses():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    line = "4242 (data (plane) 1) S 1 4242 4242 0 -1 4194560 10 0 0 0 137 42 0 0 20 0 9 0 100 0 0"
    assert stat_user_system(line) == (137, 42)
    assert stat_ticks(line) == 179
