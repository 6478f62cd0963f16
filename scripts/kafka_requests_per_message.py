"""Kafka requests per p2p message, counted from the broker's own request log, by API, client and topic.

Starts the suite as `make bench` does (bench.brokers) with `KAFKA_REQUEST_LOG_LEVEL=DEBUG` (the local broker
then logs every completed request: infra/kafka/log4j2.properties), runs the bench's p2p load (100 persistent
QoS 1 pairs) at a fixed rate, and after a warm-up counts the "Completed request" lines of a window: requests
per second and per message, and how many fetches came back empty. The logging costs Kafka CPU: use it for
the counts, not for CPU figures (scripts/syscalls_per_message.py measures those).

    .venv/bin/python scripts/kafka_requests_per_message.py [rate=1000] [window_s=20] [warmup_s=60]
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile import SteadyLoad  # noqa: E402

MARK = "Completed request:"


def request_line(line: str) -> tuple[float, dict] | None:
    """(epoch seconds, the request's JSON) of one request-log line; None for any other line."""
    if MARK not in line or not line.startswith("["):
        return None
    stamp = datetime.strptime(line[1:line.index("]")], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    body = line[line.index(MARK) + len(MARK):]
    return stamp, json.loads(body[:body.rindex("}") + 1])


def describe(req: dict) -> tuple[tuple[str, str, str], bool]:
    """((API, client id, topics), empty fetch?) of one logged request."""
    header = req["requestHeader"]
    api, topics, empty = header["requestApiKeyName"], "", False
    if api in ("FETCH", "PRODUCE"):
        parts = req.get("request", {}).get("topics") or req.get("request", {}).get("topicData") or []
        topics = ",".join(sorted({t.get("topic") or t.get("name") or "?" for t in parts}))
    if api == "FETCH":
        empty = not any(p.get("recordsSizeInBytes", 0) for t in req.get("response", {}).get("responses", ())
                        for p in t.get("partitions", ()))
    return (api, header.get("clientId", ""), topics), empty


def main() -> None:
    args = [float(a) for a in sys.argv[1:4]]
    rate, window, warmup = args + [1000.0, 20.0, 60.0][len(args):]
    os.environ["KAFKA_REQUEST_LOG_LEVEL"] = "DEBUG"
    with SteadyLoad("tbmq", rate=rate, seconds=warmup + window + 5) as load:
        time.sleep(warmup)
        t0 = time.time()
        time.sleep(window)
        t1 = time.time()
        logs = list(Path(load.workdir).rglob("kafka.log"))
        counts, empties = Counter(), Counter()
        for log in logs:
            with open(log, errors="replace") as f:
                for line in f:
                    parsed = request_line(line)
                    if parsed is None or not t0 <= parsed[0] < t1:
                        continue
                    key, empty = describe(parsed[1])
                    counts[key] += 1
                    empties[key] += empty
    span = t1 - t0
    total = sum(counts.values())
    print(f"{rate:.0f} msg/s p2p, {window:.0f} s window after {warmup:.0f} s ({len(logs)} request log(s))")
    print(f"{'req/s':>8} {'per msg':>8} {'empty/s':>8}  API, client, topics")
    for (api, client, topics), n in counts.most_common():
        print(f"{n / span:8.1f} {n / span / rate:8.3f} {empties[(api, client, topics)] / span:8.1f}  "
              f"{api}, {client}{', ' + topics if topics else ''}")
    print(f"{total / span:8.1f} {total / span / rate:8.3f}           in all")


if __name__ == "__main__":
    main()
