"""Loaded by every Python process started with this folder on PYTHONPATH (scripts/cpu_profile.py does it): in
the one service named by CPU_PROFILE_SERVICE (its OTEL_SERVICE_NAME), profile the main thread with cProfile
timed by that thread's CPU clock (time.thread_time), from CPU_PROFILE_AT seconds after start for
CPU_PROFILE_FOR seconds, then write the stats to CPU_PROFILE_OUT. Measurement only; every other process is
untouched. The profiler is switched from a helper thread by a real-time signal (SIGRTMIN+3: the router's
Faust worker takes SIGUSR1 and SIGUSR2) to the main thread, because cProfile profiles the thread that
enables it."""

import os
import signal
import threading
import time

if os.environ.get("CPU_PROFILE_SERVICE") and os.environ.get("OTEL_SERVICE_NAME") == os.environ["CPU_PROFILE_SERVICE"]:
    import cProfile

    _prof = cProfile.Profile(time.thread_time)
    _on = [False]
    _main = threading.main_thread().ident
    _SIG = signal.SIGRTMIN + 3

    def _toggle(*_):
        if not _on[0]:
            _on[0] = True
            _prof.enable()
        else:
            _prof.disable()
            _prof.dump_stats(os.environ["CPU_PROFILE_OUT"])

    def _control():
        time.sleep(float(os.environ.get("CPU_PROFILE_AT", "60")))
        signal.pthread_kill(_main, _SIG)
        time.sleep(float(os.environ.get("CPU_PROFILE_FOR", "20")))
        signal.pthread_kill(_main, _SIG)

    signal.signal(_SIG, _toggle)
    threading.Thread(target=_control, name="cpu-profile", daemon=True).start()
