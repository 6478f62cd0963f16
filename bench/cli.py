"""`python -m bench [run] ...` and `python -m bench profile ...`."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import calibrate, report
from .brokers import BROKERS, BrokerUnavailable, make_workdir
from .gen import Generator
from .procmon import ProcMonitor, layout_cpus, parse_layouts, renice_tree
from .scenarios import Profile, Runner, expand
from .stats import parse_rates

RESULTS = Path(__file__).resolve().parent / "results"
DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"


def machine() -> dict:
    model = "?"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except Exception:
        pass
    try:
        import psutil
        mem = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:
        mem = None
    return {"nproc": os.cpu_count(), "cpu_model": model, "mem_gib": mem, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "host_speed": calibrate.host_speed()}


def _exe() -> str:
    rel = os.path.relpath(sys.executable)
    return sys.executable if rel.startswith("..") else rel


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description="tbmq-py vs Mosquitto vs amqtt benchmark")
    sub = ap.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="run scenarios (default command)")
    _run_args(run)
    prof = sub.add_parser("profile", help="py-spy profile of a broker's processes under p2p load")
    prof.add_argument("--broker", default="tbmq", choices=sorted(BROKERS))
    prof.add_argument("--mode", default="p2p", choices=("p2p", "p2p-clean", "publish"),
                      help="p2p pairs (persistent subscribers), p2p-clean (clean-session subscribers), or "
                           "publishers only (the PUBLISH→PUBACK ingestion path)")
    prof.add_argument("--rate", type=float, default=1000, help="msg/s in during the profile")
    prof.add_argument("--pairs", type=int, default=50)
    prof.add_argument("--seconds", type=float, default=20)
    prof.add_argument("--rate-hz", type=int, default=100, help="py-spy sampling rate")
    prof.add_argument("--top", type=int, default=12)
    prof.add_argument("--out", type=Path, default=RESULTS)
    prof.add_argument("--no-pin", action="store_true")
    prof.add_argument("--workers", type=int, default=0)
    return ap


def _run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--brokers", default="tbmq,mosquitto,amqtt", help="comma list of tbmq,mosquitto,amqtt")
    ap.add_argument("--scenarios", default="all",
                    help="p2p, fan-in (= fan-in-app,fan-in-dev), fan-out (= fan-out-q0,fan-out-q1), backlog, "
                         "backlog-100k, backlog-app (backlogs = the three), connect, connections (memory and CPU "
                         "per held connection; always run first), faults, or all")
    ap.add_argument("--layout", default="both",
                    help="whole (nothing pinned: broker and generator share every cpu, as under `make run`), "
                         "one-core (broker on cpu0, generator on cpu1), or both (default; whole first)")
    ap.add_argument("--quick", action="store_true", help="CI smoke profile: small sizes, ~2 s steps")
    ap.add_argument("--duration", type=float, help="measured seconds per step")
    ap.add_argument("--warmup", type=float, help="unmeasured seconds at the start of every step")
    ap.add_argument("--pairs", type=int, help="p2p pairs")
    ap.add_argument("--fanin-pubs", type=int)
    ap.add_argument("--fanout-subs", type=int)
    ap.add_argument("--connections", dest="held_connections", type=int,
                    help="clients held by 'connections' (default 10000, --quick 200)")
    ap.add_argument("--hold-window", type=float, help="seconds the CPU with them held is measured over (default 10)")
    ap.add_argument("--backlog", type=int, help="messages queued for the offline DEVICE subscriber ('backlog')")
    ap.add_argument("--backlog-big", type=int, help="the same for 'backlog-100k' (default 100000)")
    ap.add_argument("--backlog-app", type=int, help="messages queued for the offline APPLICATION subscriber "
                                                     "('backlog-app', default 50000)")
    ap.add_argument("--rates", "--rate", dest="rates", action="append", default=[], metavar="SCENARIO=R1[,R2...]",
                    help="fixed-rate steps (msg/s in) of a scenario, e.g. --rates p2p=100,1000,2500 (repeatable); "
                         "the max-rate search starts from the step nearest 1000 msg/s (--search-start)")
    ap.add_argument("--search", default=None, help="scenarios with a max-rate search (comma list, 'none')")
    ap.add_argument("--search-start", action="append", default=[], metavar="SCENARIO=MSG_S",
                    help="first rate of a scenario's max-rate search (default: p2p 1000, others their first rate)")
    ap.add_argument("--search-steps", type=int)
    ap.add_argument("--broker-warmup", type=float,
                    help="seconds of unmeasured p2p load after a broker starts (default 25, --quick 5)")
    ap.add_argument("--broker-warmup-rate", type=float, help="msg/s of that load (default 500, --quick 200)")
    ap.add_argument("--idle-warmup", type=float,
                    help="seconds with no clients before the broker's idle CPU is measured (default 60, --quick 5)")
    ap.add_argument("--jit-settle-max", type=float,
                    help="after the warm-up load, at most this many more seconds of it while the broker's JVM "
                         "(Kafka) is still JIT-compiling (default 120, --quick 0)")
    ap.add_argument("--idle-window", type=float, help="seconds the idle CPU is measured over (default 10)")
    ap.add_argument("--cooldown-max", type=float,
                    help="before each step wait at most this long for the broker to be back near idle CPU "
                         "(default 30, --quick 5; 0 = no cool-down)")
    ap.add_argument("--cooldown-margin", type=float, help="'near idle' = idle + this many %% of one core (default 5)")
    ap.add_argument("--mqtt-version", type=int, choices=(4, 5), help="3.1.1 (4, default) or 5 (amqtt: always 4)")
    ap.add_argument("--workers", type=int, default=0, help="generator processes (default: 2, or generator cpus)")
    ap.add_argument("--no-pin", action="store_true", help="same as --layout whole")
    ap.add_argument("--interleave", default="p2p", choices=("p2p", "none"),
                    help="p2p (default): with several brokers, they take turns at each of p2p's fixed rates (all "
                         "started at once); none: each broker runs all its scenarios alone, one after the other")
    ap.add_argument("--nice", type=int, default=None,
                    help="nice value for the broker and generator processes (e.g. -5 on a shared machine; root)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep-workdir", action="store_true", help="keep the brokers' logs and data (a tmp dir)")
    ap.add_argument("--app-pattern", default="^bench-app-.*",
                    help="TBMQ_APPLICATION_CLIENT_ID_PATTERNS given to the tbmq-py suite")
    ap.add_argument("--separate-device-persistence", action="store_true", dest="separate_device_persistence",
                    help="tbmq-py with device-persistence as a process of its own instead of inside the router "
                         "(ROUTER_PERSIST_VIA=local, what `make run` does); the launcher's option of the same name")


_PROFILE_ARGS = ("duration", "warmup", "pairs", "fanin_pubs", "fanout_subs", "backlog", "backlog_big", "backlog_app",
                 "search_steps", "broker_warmup", "broker_warmup_rate", "jit_settle_max", "idle_warmup", "idle_window",
                 "cooldown_max", "cooldown_margin", "held_connections", "hold_window")


def profile_from(args) -> Profile:
    prof = Profile.quick() if args.quick else Profile()
    for k in _PROFILE_ARGS:
        v = getattr(args, k, None)
        if v is not None:
            setattr(prof, k, v)
    if args.mqtt_version:
        prof.mqtt_version = args.mqtt_version
    prof.rates = {k: list(v) for k, v in prof.rates.items()}
    prof.search_start = dict(prof.search_start)
    for spec in args.rates:
        k, rates = parse_rates(spec)
        for s in expand(k):
            prof.rates[s] = list(rates)
            prof.search_start[s] = min(rates, key=lambda r: abs(math.log(r / 1000.0)))
    for spec in getattr(args, "search_start", None) or []:
        k, rates = parse_rates(spec)
        for s in expand(k):
            prof.search_start[s] = rates[0]
    if args.search is not None:
        prof.search = () if args.search in ("none", "") else tuple(expand(args.search))
    return prof


def _start_broker(bname: str, workdir: Path, bcpus, args, mon: ProcMonitor) -> tuple[object | None, dict]:
    """→ (started broker or None, its meta)."""
    kw = ({"app_pattern": args.app_pattern,
           "persist_in_router": not getattr(args, "separate_device_persistence", False)} if bname == "tbmq" else {})
    broker = BROKERS[bname](workdir, cpus=bcpus, **kw)
    try:
        t0 = time.monotonic()
        broker.start()
    except BrokerUnavailable as e:
        print(f"  skipped: {e}")
        return None, {"error": f"unavailable: {e}"}
    except Exception as e:
        print(f"  failed to start: {e!r}")
        broker.stop()
        return None, {"error": f"start failed: {e!r}"[:2000]}
    print(f"  started in {time.monotonic() - t0:.1f}s on {broker.host}:{broker.port}; "
          f"processes: {', '.join(f'{k}={v}' for k, v in broker.pids().items())}")
    for n in broker.notes:
        print(f"  {n}")
    for label, pid in broker.pids().items():
        mon.add(label, pid)
        if args.nice is not None:
            renice_tree(pid, args.nice)
    return broker, {"notes": broker.notes, "pids": broker.pids(), "client": broker.client_cfg}


def run_layout(layout: str, brokers: list[str], scenarios: list[str], prof: Profile, args, mon: ProcMonitor,
               workdir: Path, all_cpus: set[int]) -> dict:
    """Every broker in one cpu layout → {layout, pinning, brokers (meta), results}.

    Brokers run one after the other, except p2p's fixed-rate steps with `--interleave p2p` (the default
    when several brokers run): every broker is started, warmed up, measured idle and put through the
    scenarios listed before p2p first, then they take turns at each rate (tbmq-py, Mosquitto, amqtt at 100
    msg/s, then at 1,000, ...), so that the ratios of one rate compare steps measured minutes apart, not an
    hour; each broker's other scenarios follow, one broker after the other, while the brokers not yet done
    wait idle."""
    bcpus, gcpus = layout_cpus(layout)
    n_workers = args.workers or max(2, len(gcpus or ()))
    os.sched_setaffinity(0, gcpus or all_cpus)  # the generator's workers (spawned from here) inherit it
    print(f"\n##### layout {layout}: " + (
        f"broker processes → cpu {sorted(bcpus)}, generator ({n_workers} workers) → cpu {sorted(gcpus)}" if bcpus
        else f"nothing pinned: broker and generator ({n_workers} workers) share cpus {sorted(all_cpus)}"))
    results: dict = {s: {} for s in scenarios}
    meta: dict = {}
    t_start = time.monotonic()
    gen = Generator(n_workers, gcpus)
    interleave = getattr(args, "interleave", "none") == "p2p" and len(brokers) > 1 and "p2p" in scenarios

    def watch_gen() -> None:
        for k, v in gen.pids().items():
            mon.add(k, v)

    def new_gen() -> None:
        """A worker that timed out may still be busy: a new generator for every runner."""
        nonlocal gen
        gen.close()
        mon.remove_prefix("generator-")
        gen = Generator(n_workers, gcpus)
        watch_gen()
        for r in runners.values():
            r.gen = gen

    def failed(bname: str, error: str) -> None:
        meta[bname]["error"] = error[:2000]
        for s in scenarios:
            results[s].setdefault(bname, {"error": error[:300]})

    def prepare(bname: str) -> None:
        """Start, warm up and measure idle: `runners[bname]` when the broker is usable."""
        print(f"\n=== {bname} ({layout}) ===")
        broker, meta[bname] = _start_broker(bname, workdir / layout, bcpus, args, mon)
        if broker is None:
            for s in scenarios:
                results[s][bname] = {"error": meta[bname]["error"][:300]}
            return
        started[bname] = broker
        runner = Runner(broker, gen, mon, prof)
        try:
            w = runner.warm_up()
            if w:
                meta[bname]["warmup_load"] = w
                print(f"  warm-up load: {w['seconds']:.0f}s of p2p at {w['rate']:.0f}/s (not measured), "
                      f"broker {w['broker_cpu_pct']:.0f}% of a core, {w['us_per_msg'].get('total', math.nan):.0f}"
                      " µs/msg")
                if w.get("jit"):
                    j = w["jit"]
                    print(f"  JIT: {'settled' if j['settled'] else 'NOT settled'} after {j['extra_s']:.0f}s more "
                          f"(compiler threads {j['last_chunk_pct']:.1f}% of a core in the last chunk, "
                          f"{j['compile_cpu_s']:.0f}s of CPU since the JVM started)")
            idle = runner.measure_idle()
            meta[bname]["idle"] = idle
            parts = ", ".join("%s %.1f%%" % (k, v["cpu_pct"]) for k, v in idle["processes"].items())
            print(f"  idle CPU after {idle['after_s']:.0f}s with no clients: {idle['total_pct']:.1f}% of one core "
                  f"({parts})")
        except Exception as e:  # warm-up / idle failed: the broker is unusable, the others still run
            print(f"  ERROR before the scenarios: {type(e).__name__}: {e}")
            failed(bname, f"{type(e).__name__}: {e}")
            return
        runners[bname] = runner

    def scenario_failed(bname: str, s: str, e: Exception) -> None:
        """A scenario (or an interleaved step) raised: recorded; the generator is replaced."""
        print(f"    ERROR: {type(e).__name__}: {e}")
        results[s][bname] = {"error": f"{type(e).__name__}: {e}"[:500]}
        new_gen()

    def scenario(bname: str, s: str, steps: list[dict] | None = None) -> None:
        broker, runner = started[bname], runners[bname]
        if hasattr(broker, "repin"):
            broker.repin()
        try:
            results[s][bname] = runner.p2p(s in prof.search, steps) if steps is not None else runner.run(
                s, s in prof.search)
        except Exception as e:
            scenario_failed(bname, s, e)

    def finish(bname: str) -> None:
        broker = started.pop(bname)
        runners.pop(bname, None)
        for label in broker.pids():
            mon.remove_prefix(label)
        broker.stop()

    def interleaved_p2p() -> dict[str, list[dict]]:
        """p2p's fixed-rate steps, the brokers taking turns at each rate; every broker's processes back near
        their idle CPU before each step (not only those of the broker measured)."""
        steps: dict[str, list[dict]] = {b: [] for b in runners}
        print(f"\n=== p2p, fixed rates interleaved: {', '.join(runners)} at each rate ===")
        for rate in prof.rates["p2p"]:
            for bname in [b for b in runners if b in steps]:
                print(f"  -- {bname}")
                for other, r in runners.items():
                    if other != bname:
                        r.cooldown()
                try:
                    steps[bname].append(runners[bname].interleaved_step(rate))
                except Exception as e:  # no p2p for this broker; its other scenarios still run
                    del steps[bname]
                    scenario_failed(bname, "p2p", e)
                if not started[bname].alive():
                    print("    broker died")
                    results["p2p"].setdefault(bname, {"error": "the broker died during the interleaved steps"})
                    runners.pop(bname)
                    steps.pop(bname, None)
        return steps

    started: dict = {}
    runners: dict[str, Runner] = {}
    watch_gen()
    try:
        def run_scenarios(bname: str, names: list[str]) -> None:
            for s in names:
                if bname not in runners:
                    return  # unusable, or died in an earlier scenario
                if interleave and s == "p2p" and bname not in fixed:
                    continue  # its error is recorded
                print(f"  -- {s} ({bname})")
                scenario(bname, s, fixed.get(bname) if s == "p2p" else None)
                if not started[bname].alive():
                    print("    broker died")
                    runners.pop(bname)

        fixed: dict[str, list[dict]] = {}
        # with interleaving, the scenarios listed before p2p run on each broker before the turns start (held
        # connections first: its bytes per connection want a broker that has not freed memory yet)
        before = scenarios[:scenarios.index("p2p")] if interleave else []
        after = scenarios[scenarios.index("p2p") + 1:] if interleave else scenarios
        if interleave:
            for bname in brokers:
                prepare(bname)
                run_scenarios(bname, before)
            fixed = interleaved_p2p()
            after = ["p2p", *after]
        for bname in brokers:
            if not interleave:
                prepare(bname)
            run_scenarios(bname, after)
            if bname in started:
                finish(bname)
    finally:
        for bname in list(started):
            finish(bname)
        gen.close()
        mon.remove_prefix("generator-")
    return {"layout": layout, "pinning": {"broker": sorted(bcpus) if bcpus else None,
                                          "generator": sorted(gcpus) if gcpus else None, "workers": n_workers},
            "interleaved": ["p2p"] if interleave else [],
            "brokers": meta, "results": results, "elapsed_s": round(time.monotonic() - t_start, 1)}


def run(args) -> int:
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    for b in brokers:
        if b not in BROKERS:
            print(f"unknown broker {b!r}; known: {', '.join(BROKERS)}", file=sys.stderr)
            return 2
    try:
        layouts = ["whole"] if args.no_pin else parse_layouts(args.layout)
        scenarios = expand(args.scenarios)
        prof = profile_from(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    all_cpus = set(os.sched_getaffinity(0))
    mach = machine()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    print(f"machine: {mach['nproc']} cpus ({mach['cpu_model']}), {mach['mem_gib']} GiB, load {mach['loadavg_at_start']}; "
          f"{report.host_speed_text(mach['host_speed'])}")
    print(f"profile: {'quick' if args.quick else 'full'}; layouts {', '.join(layouts)}; scenarios "
          f"{', '.join(scenarios)}; brokers {', '.join(brokers)}")
    print(f"fixed rates: {'; '.join(f'{k} ' + ','.join(f'{r:g}' for r in v) for k, v in prof.rates.items() if k in scenarios)}"
          f"; per broker: {prof.broker_warmup:g}s warm-up load, idle after {prof.idle_warmup:g}s, cool-down ≤ "
          f"{prof.cooldown_max:g}s to idle+{prof.cooldown_margin:g}%")
    workdir = make_workdir()
    mon = ProcMonitor(probe_speed=True).start()
    if args.nice is not None:
        renice_tree(os.getpid(), args.nice)  # the workers inherit it
        print(f"nice: {args.nice} for the broker and generator processes")
    runs: dict = {}
    t_start = time.monotonic()
    try:
        for layout in layouts:
            runs[layout] = run_layout(layout, brokers, scenarios, prof, args, mon, workdir, all_cpus)
    finally:
        os.sched_setaffinity(0, all_cpus)
        mon.stop()
        if args.keep_workdir:
            print(f"broker logs and data kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - t_start
    for layout, r in runs.items():
        print(f"\n##### layout {layout}\n")
        print(report.layout_text(r, brokers))
    doc = {
        "timestamp": stamp, "command": " ".join([_exe(), "-m", "bench", *sys.argv[1:]]),
        "machine": mach, "nice": args.nice, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "host_speed_at_end": calibrate.host_speed(),
        "profile": {**prof.__dict__, "faults": prof.faults.__dict__}, "broker_order": brokers, "layouts": runs, "elapsed_s": round(elapsed, 1),
    }
    out_json = args.out / f"{stamp}.json"
    report.save_json(out_json, doc)
    pngs = render_charts(out_json, doc)
    print(f"\nresults: {out_json}\ncharts:  {', '.join(str(p) for p in pngs)}\ntook {elapsed:.0f}s")
    return 0


def render_charts(src: Path, doc: dict) -> list[Path]:
    """<stamp>.png: e2e latency (p50, p99) against in-rate, every layout; <stamp>-<layout>.png: the summary."""
    m = doc["machine"]
    title = f"{m['nproc']}× {m['cpu_model']} — {doc['timestamp']} — {doc['command']}"
    runs = report.runs_of(doc)
    brokers = report.broker_order(doc)
    out = []
    jobs = [(src.with_suffix(".png"), lambda p: report.latency_chart(p, runs, brokers, title=title))]
    for layout, r in runs.items():
        jobs.append((src.with_name(f"{src.stem}-{layout}.png"),
                     lambda p, r=r, layout=layout: report.chart(p, r["results"], brokers,
                                                                title=f"{layout} — {title}")))
    for path, fn in jobs:
        try:
            fn(path)
            out.append(path)
        except Exception as e:  # a chart is a convenience; never lose the JSON for it
            print(f"chart {path.name} failed: {e!r}")
    return out


def doc_cmd(argv: list[str]) -> int:
    """python -m bench doc results.json [profile-summary.md] [--write [docs/performance.md]]"""
    import json
    ap = argparse.ArgumentParser(prog="python -m bench doc",
                                 description="the results section of docs/performance.md from a run")
    ap.add_argument("results", type=Path)
    ap.add_argument("profile_md", type=Path, nargs="?", help="a py-spy profile summary to append")
    ap.add_argument("--write", type=Path, nargs="?", const=DOC, default=None, metavar="DOC",
                    help=f"replace the section between the markers in DOC (default {DOC.relative_to(DOC.parents[1])})"
                         " instead of printing it")
    a = ap.parse_args(argv)
    section = report.doc_section(json.loads(a.results.read_text()),
                                 a.profile_md.read_text() if a.profile_md else None)
    if a.write is None:
        print(section)
        return 0
    try:
        a.write.write_text(report.replace_section(a.write.read_text(), section))
    except ValueError as e:
        print(f"{a.write}: {e}", file=sys.stderr)
        return 1
    print(f"{a.write}: results section replaced from {a.results}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "doc":
        return doc_cmd(argv[1:])
    if argv and argv[0] == "kafka-clients":  # aiokafka against librdkafka on one local Kafka (issue 12, 3.)
        from .kafka_clients import build_parser as kc_parser, drive
        return drive(kc_parser().parse_args(argv[1:]))
    if argv and argv[0] == "chart":  # python -m bench chart results.json: re-render the PNGs next to it
        import json
        src = Path(argv[1])
        for p in render_charts(src, json.loads(src.read_text())):
            print(p)
        return 0
    if not argv or argv[0] not in ("run", "profile", "-h", "--help"):
        argv = ["run", *argv]
    args = build_parser().parse_args(argv)
    if args.cmd == "profile":
        from .profile import profile
        return profile(args)
    return run(args)
