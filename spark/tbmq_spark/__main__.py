"""python -m tbmq_spark stats|archive|report|package ... (spark-submit: spark/submit.py, same arguments)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import zipfile

from . import SPARK_DIR

log = logging.getLogger("tbmq_spark")

DEFAULT_OUTPUT = os.environ.get("TBMQ_SPARK_OUTPUT", ".run/spark")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tbmq_spark", description="tbmq-py Spark jobs (docs/spark.md)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, kafka=True):
        p.add_argument("--output", default=DEFAULT_OUTPUT, help="Parquet/report root (default %(default)s)")
        p.add_argument("--master", default=None,
                       help="Spark master (default local[2]; ignored under spark-submit, use its --master)")
        p.add_argument("--conf", action="append", default=[], metavar="K=V", help="extra Spark setting")
        if kafka:
            p.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "localhost:9092"),
                           help="Kafka bootstrap servers (default $KAFKA_BOOTSTRAP_SERVERS or %(default)s)")

    s = sub.add_parser("stats", help="streaming statistics to Parquet and tbmq.sys.historical.data")
    common(s)
    s.add_argument("--checkpoint", default=None, help="default <output>/_checkpoints/stats")
    s.add_argument("--window", default="1 minute")
    s.add_argument("--watermark", default="1 minute", help="allowed lateness (default %(default)s)")
    s.add_argument("--trigger", default="processingTime=10 seconds",
                   help="processingTime=<interval> (default), availableNow or once")
    s.add_argument("--starting-offsets", default="earliest")
    s.add_argument("--max-offsets-per-trigger", type=int, default=None)
    s.add_argument("--no-publish", action="store_true", help="Parquet only, no tbmq.sys.historical.data")
    s.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    s.add_argument("--ready-file", default=None,
                   help="write this file (JSON: pid, query id) once the streaming query is active "
                        "(the launcher's readiness signal)")

    a = sub.add_parser("archive", help="event log to Parquet + rebuild check of the compacted projections")
    common(a)
    a.add_argument("--no-ingest", action="store_true", help="only the rebuild check")
    a.add_argument("--no-check", action="store_true", help="only the archive")

    r = sub.add_parser("report", help="PNG charts + text summary from the stats Parquet")
    common(r, kafka=False)
    r.add_argument("--out-dir", default=None, help="default <output>/report")

    k = sub.add_parser("package", help="zip tbmq_spark + tbmq.v1 for spark-submit --py-files")
    k.add_argument("--dest", default="dist/tbmq_spark.zip")
    return ap


def _conf(items: list[str]) -> dict[str, str]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise SystemExit(f"--conf {it!r}: expected KEY=VALUE")
        out[k] = v
    return out


def package(dest: str) -> str:
    """A zip for --py-files: tbmq_spark and the generated tbmq.v1 (workers also need protobuf, pyarrow,
    pandas; and tbmq_platform for the topic catalogue)."""
    import tbmq
    import tbmq_platform

    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    roots = [(str(SPARK_DIR), "tbmq_spark"),
             (os.path.dirname(list(tbmq.__path__)[0]), "tbmq"),
             (os.path.dirname(os.path.dirname(tbmq_platform.__file__)), "tbmq_platform")]
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for base, pkg in roots:
            for dirpath, _dirs, files in os.walk(os.path.join(base, pkg)):
                for f in files:
                    if f.endswith(".py"):
                        full = os.path.join(dirpath, f)
                        z.write(full, os.path.relpath(full, base))
    return dest


def _signal_ready(path: str | None, query) -> None:
    """The readiness signal of a started stats query: a line in the log and (with --ready-file) a JSON file
    written atomically (tmp + rename)."""
    info = {"pid": os.getpid(), "query": query.name, "id": str(query.id), "run_id": str(query.runId),
            "started_at_ms": int(time.time() * 1000)}
    print(f"tbmq_spark: stats query started: {json.dumps(info)}", flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)


def _stop_on_signal(stop: threading.Event | None = None) -> threading.Event:
    """SIGTERM (launcher, systemd, docker stop) and SIGINT (Ctrl-C) set the returned event: run_stats sees it
    within STOP_POLL_S, stops the query and returns, and the session is closed before the process exits. The
    handler raises nothing (an exception inside a py4j call breaks the gateway). A second signal ends the
    process at once."""
    stop = stop if stop is not None else threading.Event()

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        log.info("signal %d: stopping the stats query", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "stats":
        stop = _stop_on_signal()
        if args.ready_file and os.path.exists(args.ready_file):
            os.remove(args.ready_file)         # a stale signal of an earlier run
    if args.cmd == "package":
        print(package(args.dest))
        return 0
    if args.cmd == "report":
        from .report import render

        res = render(args.output, args.out_dir)
        print(res.summary, end="")
        for c in res.charts:
            print(f"chart: {c}")
        return 0

    from .session import get_session

    spark = get_session(f"tbmq-{args.cmd}", args.master, conf=_conf(args.conf))
    if args.cmd == "stats":
        from .stats import StatsConfig, run_stats

        cfg = StatsConfig(bootstrap=args.bootstrap, output=args.output, checkpoint=args.checkpoint,
                          window=args.window, watermark=args.watermark, trigger=args.trigger,
                          starting_offsets=args.starting_offsets,
                          max_offsets_per_trigger=args.max_offsets_per_trigger, publish=not args.no_publish)
        _stop_on_signal(stop)      # again: the SparkContext installed its own SIGINT handler
        try:
            run_stats(spark, cfg, args.timeout, on_started=lambda q: _signal_ready(args.ready_file, q),
                      stop=stop)
            if stop.is_set():
                print("tbmq_spark: stats query stopped (signal)", flush=True)
        finally:
            if args.ready_file and os.path.exists(args.ready_file):
                os.remove(args.ready_file)
            spark.stop()
        return 0
    if args.cmd == "archive":
        from .archive import ArchiveConfig, run_archive

        rep = run_archive(spark, ArchiveConfig(bootstrap=args.bootstrap, output=args.output),
                          ingest=not args.no_ingest, check=not args.no_check)
        if rep is not None:
            print(rep.text())
            return 0 if rep.consistent else 1
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
