"""`python -m bench [run] ...` and `python -m bench profile ...`."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import report
from .brokers import BROKERS, BrokerUnavailable, make_workdir
from .gen import Generator
from .procmon import ProcMonitor, cpu_layout, renice_tree
from .scenarios import Profile, Runner, expand

RESULTS = Path(__file__).resolve().parent / "results"


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
            "python": platform.python_version(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}


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
    ap.add_argument("--scenarios", default="all", help="p2p,fan-in,fan-out(-q0,-q1),backlog,connect or all")
    ap.add_argument("--quick", action="store_true", help="CI smoke profile: small sizes, ~2 s steps")
    ap.add_argument("--duration", type=float, help="measured seconds per step")
    ap.add_argument("--warmup", type=float)
    ap.add_argument("--pairs", type=int, help="p2p pairs")
    ap.add_argument("--fanin-pubs", type=int)
    ap.add_argument("--fanout-subs", type=int)
    ap.add_argument("--backlog", type=int, help="messages queued for the offline subscriber")
    ap.add_argument("--rate", action="append", default=[], metavar="SCENARIO=MSG_S",
                    help="fixed in-rate of a scenario, e.g. --rate p2p=2000 (repeatable)")
    ap.add_argument("--search", default=None, help="scenarios with a max-rate search (comma list, 'none')")
    ap.add_argument("--search-steps", type=int)
    ap.add_argument("--mqtt-version", type=int, choices=(4, 5), help="3.1.1 (4, default) or 5 (amqtt: always 4)")
    ap.add_argument("--workers", type=int, default=0, help="generator processes (default: 2, or generator cpus)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin broker / generator to separate cpus")
    ap.add_argument("--nice", type=int, default=None,
                    help="nice value for the broker and generator processes (e.g. -5 on a shared machine; root)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep-workdir", action="store_true", help="keep the brokers' logs and data (a tmp dir)")
    ap.add_argument("--app-pattern", default="^bench-app-.*",
                    help="TBMQ_APPLICATION_CLIENT_ID_PATTERNS given to the tbmq-py suite")


def profile_from(args) -> Profile:
    prof = Profile.quick() if args.quick else Profile()
    for k in ("duration", "warmup", "pairs", "fanin_pubs", "fanout_subs", "backlog", "search_steps"):
        v = getattr(args, k, None)
        if v is not None:
            setattr(prof, k, v)
    if args.mqtt_version:
        prof.mqtt_version = args.mqtt_version
    for spec in args.rate:
        k, v = spec.split("=", 1)
        for s in expand(k):
            prof.rates[s] = float(v)
    if args.search is not None:
        prof.search = () if args.search in ("none", "") else tuple(expand(args.search))
    return prof


def run(args) -> int:
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    for b in brokers:
        if b not in BROKERS:
            print(f"unknown broker {b!r}; known: {', '.join(BROKERS)}", file=sys.stderr)
            return 2
    scenarios = expand(args.scenarios)
    prof = profile_from(args)
    bcpus, gcpus = (None, None) if args.no_pin else cpu_layout()
    n_workers = args.workers or max(2, len(gcpus or ()))
    mach = machine()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    print(f"machine: {mach['nproc']} cpus ({mach['cpu_model']}), {mach['mem_gib']} GiB, load {mach['loadavg_at_start']}")
    if bcpus:
        print(f"pinning: broker processes → cpu {sorted(bcpus)}, generator ({n_workers} workers) → cpu {sorted(gcpus)}")
    else:
        print("pinning: off" + ("" if args.no_pin else " (fewer than 2 cpus)"))
    print(f"profile: {'quick' if args.quick else 'full'}; scenarios {', '.join(scenarios)}; brokers {', '.join(brokers)}")
    if gcpus:
        os.sched_setaffinity(0, gcpus)
    workdir = make_workdir()
    results: dict = {s: {} for s in scenarios}
    meta: dict = {}
    mon = ProcMonitor().start()
    if args.nice is not None:
        renice_tree(os.getpid(), args.nice)  # the workers inherit it
        print(f"nice: {args.nice} for the broker and generator processes")
    gen = Generator(n_workers, gcpus)
    mon_labels = gen.pids()
    for k, v in mon_labels.items():
        mon.add(k, v)
    t_start = time.monotonic()
    try:
        for bname in brokers:
            print(f"\n=== {bname} ===")
            broker = BROKERS[bname](workdir, cpus=bcpus)
            try:
                t0 = time.monotonic()
                broker.start()
            except BrokerUnavailable as e:
                print(f"  skipped: {e}")
                for s in scenarios:
                    results[s][bname] = {"error": f"unavailable: {e}"}
                meta[bname] = {"error": str(e)}
                continue
            except Exception as e:
                print(f"  failed to start: {e!r}")
                for s in scenarios:
                    results[s][bname] = {"error": f"start failed: {e!r}"[:300]}
                meta[bname] = {"error": repr(e)[:2000]}
                broker.stop()
                continue
            print(f"  started in {time.monotonic() - t0:.1f}s on {broker.host}:{broker.port}; "
                  f"processes: {', '.join(f'{k}={v}' for k, v in broker.pids().items())}")
            for n in broker.notes:
                print(f"  {n}")
            meta[bname] = {"notes": broker.notes, "pids": broker.pids(), "client": broker.client_cfg}
            for label, pid in broker.pids().items():
                mon.add(label, pid)
                if args.nice is not None:
                    renice_tree(pid, args.nice)
            # idle baseline: what the broker's processes burn with connected-nothing (background polling)
            win = mon.window_start()
            time.sleep(3.0 if not args.quick else 1.0)
            idle = {k: v for k, v in mon.window_end(win).items() if not k.startswith("generator-")}
            meta[bname]["idle"] = idle
            parts = ", ".join("%s %.1f%%" % (k, v["cpu_pct"]) for k, v in idle.items())
            print(f"  idle CPU: {sum(v['cpu_pct'] for v in idle.values()):.1f}% of one core ({parts})")
            runner = Runner(broker, gen, mon, prof)
            try:
                for s in scenarios:
                    print(f"  -- {s}")
                    if hasattr(broker, "repin"):
                        broker.repin()
                    try:
                        results[s][bname] = runner.run(s, s in prof.search)
                    except Exception as e:
                        print(f"    ERROR: {type(e).__name__}: {e}")
                        results[s][bname] = {"error": f"{type(e).__name__}: {e}"[:500]}
                        # a worker that timed out may still be busy: restart the generator
                        gen.close()
                        for k in list(mon_labels):
                            mon.remove_prefix(k)
                        gen = Generator(n_workers, gcpus)
                        mon_labels = gen.pids()
                        for k, v in mon_labels.items():
                            mon.add(k, v)
                        runner.gen = gen
                    if not broker.alive():
                        print("    broker died")
                        break
            finally:
                for label in broker.pids():
                    mon.remove_prefix(label)
                broker.stop()
    finally:
        gen.close()
        mon.stop()
        if args.keep_workdir:
            print(f"broker logs and data kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - t_start
    text = report.table(results, brokers)
    print("\n" + text)
    ptext = report.process_table(results)
    print("\nprocesses (CPU % of one core, peak RSS) during the fixed-rate step:\n" + ptext)
    doc = {
        "timestamp": stamp, "command": " ".join([_exe(), "-m", "bench", *sys.argv[1:]]),
        "machine": mach, "pinning": {"broker": sorted(bcpus) if bcpus else None,
                                     "generator": sorted(gcpus) if gcpus else None, "workers": n_workers},
        "nice": args.nice, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "profile": prof.__dict__, "brokers": meta, "results": results, "elapsed_s": round(elapsed, 1),
        "table_md": report.table(results, brokers, "md"),
        "processes_md": report.process_table(results, "md"),
    }
    out_json = args.out / f"{stamp}.json"
    report.save_json(out_json, doc)
    out_png = args.out / f"{stamp}.png"
    try:
        report.chart(out_png, results, brokers,
                     title=f"{mach['nproc']}× {mach['cpu_model']} — {stamp} — {doc['command']}")
    except Exception as e:  # the chart is a convenience; never lose the JSON for it
        print(f"chart failed: {e!r}")
    print(f"\nresults: {out_json}\nchart:   {out_png}\ntook {elapsed:.0f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "doc":  # python -m bench doc results.json [profile-summary.md]
        import json
        doc = json.loads(Path(argv[1]).read_text())
        print(report.doc_section(doc, Path(argv[2]).read_text() if len(argv) > 2 else None))
        return 0
    if argv and argv[0] == "chart":  # python -m bench chart results.json: re-render the PNG next to it
        import json
        src = Path(argv[1])
        doc = json.loads(src.read_text())
        m = doc["machine"]
        report.chart(src.with_suffix(".png"), doc["results"], list(doc.get("brokers") or []),
                     title=f"{m['nproc']}× {m['cpu_model']} — {doc['timestamp']} — {doc['command']}")
        print(src.with_suffix(".png"))
        return 0
    if not argv or argv[0] not in ("run", "profile", "-h", "--help"):
        argv = ["run", *argv]
    args = build_parser().parse_args(argv)
    if args.cmd == "profile":
        from .profile import profile
        return profile(args)
    return run(args)
