"""Subscription trie benchmark: ``python -m tbmq_routing.bench [--sizes 10000,100000,1000000]``.

For each size N it builds a SubscriptionTrie with a realistic mix and measures:

* build rate (adds/s) and memory: RSS delta of this process (/proc/self/statm, after
  ``gc.collect()``) across the build, including the Subscription objects and the client id and
  filter strings -> bytes per subscription;
* ``match()`` throughput on one core with P2P-style topics (best of 3 passes), and
  ``match()`` + ``plan_routing()`` throughput (synthetic session views, QoS 1);
* ``replace_client`` and ``remove_client`` rates; node count back to 0 after removing all.

Mix (per 1000 subscriptions): 940 P2P ``europe/ua/kyiv/<n>/+`` (one per client); 15 ``#``
wildcards ``europe/<country>/<city>/#`` over N/1000 other cities, of which 5 in all are
``europe/#`` and 5 ``europe/ua/kyiv/#``; 15 ``europe/+/kyiv/<n>/temperature``; 30 shared DEVICE
``$share/g<k>/europe/ua/kyiv/<n>/+`` (stored as the filter with share_name). Matched topics:
``europe/ua/kyiv/<n>/temperature`` for random n (94%; about 10 matches each: its P2P and shared
subscription plus the 10 dashboards), 5% misses (``asia/...``) and 1% ``$SYS/...``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time

from .rules import APPLICATION, DEVICE, PublishInfo, RoundRobin, SessionView, plan_routing
from .trie import Subscription, SubscriptionTrie

# session views for the plan_routing measurement (picked by a cheap function of the client id)
_VIEWS = [SessionView(False, "", DEVICE, True), SessionView(True, "connector-1", DEVICE, False),
          SessionView(True, "connector-2", DEVICE, True), SessionView(True, "connector-1", APPLICATION, True)]


def _session(client_id: str) -> SessionView:
    return _VIEWS[len(client_id) & 3]


CITIES = ["kyiv", "lviv", "odesa", "kharkiv", "dnipro", "warsaw", "berlin", "paris", "rome", "madrid"]
COUNTRIES = ["ua", "pl", "de", "fr", "it", "es"]


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _subscriptions(n: int, rnd: random.Random):
    """Yield (filter, Subscription) for n subscriptions (realistic mix, see module doc)."""
    ncities = max(10, n // 1000)  # wildcard subscriptions spread over many city prefixes
    for i in range(n):
        r = i % 1000
        if r < 940:
            yield f"europe/ua/kyiv/{i}/+", Subscription(f"dev{i}", qos=1)
        elif r < 955:
            if r == 940 and i < 5000:  # 5 global dashboards
                yield "europe/#", Subscription(f"app{i}", qos=1, subscription_id=7)
                continue
            if r == 941 and i < 5000:  # 5 city dashboards on the P2P prefix
                yield "europe/ua/kyiv/#", Subscription(f"app{i}", qos=0)
                continue
            city = f"city{rnd.randrange(ncities)}"
            country = COUNTRIES[rnd.randrange(len(COUNTRIES))]
            yield f"europe/{country}/{city}/#", Subscription(f"app{i}", qos=1, subscription_id=i % 1000 + 1)
        elif r < 970:
            yield f"europe/+/kyiv/{rnd.randrange(n)}/temperature", Subscription(f"mon{i}", qos=0)
        else:
            yield f"europe/ua/kyiv/{i}/+", Subscription(f"sh{i}", qos=1, share_name=f"g{i % 50}")


def _topics(n: int, count: int, rnd: random.Random) -> list[str]:
    out = []
    for _ in range(count):
        r = rnd.random()
        if r < 0.94:
            out.append(f"europe/ua/kyiv/{rnd.randrange(n)}/temperature")
        elif r < 0.99:
            out.append(f"asia/cn/{CITIES[rnd.randrange(len(CITIES))]}/{rnd.randrange(n)}/temperature")
        else:
            out.append(f"$SYS/brokers/{rnd.randrange(100)}/load")
    return out


def run(n: int, match_count: int, seed: int = 1, freeze: bool = False) -> dict:
    rnd = random.Random(seed)
    topics = _topics(n, match_count, rnd)
    gc.collect()
    try:
        rss0 = _rss()
        trie = SubscriptionTrie()
        t0 = time.perf_counter()
        for f, sub in _subscriptions(n, rnd):
            trie.add(f, sub)
        build_s = time.perf_counter() - t0
        gc.collect()
        rss1 = _rss()
        if freeze:
            gc.freeze()  # what a service should do after rebuilding its state

        # match throughput (best of 3 passes)
        match = trie.match
        best = float("inf")
        total_matched = 0
        for _ in range(3):
            t0 = time.perf_counter()
            total_matched = 0
            for t in topics:
                total_matched += len(match(t))
            best = min(best, time.perf_counter() - t0)

        # match + plan_routing (QoS 1 publishes, synthetic session views)
        rr = RoundRobin()
        pubs = [PublishInfo("publisher", t, 1) for t in topics[: max(1, match_count // 4)]]
        t0 = time.perf_counter()
        for p in pubs:
            plan_routing(p, match(p.topic), _session, rr)
        plan_s = time.perf_counter() - t0

        # replace_client: move 10k P2P clients to a new filter set (2 filters each)
        k = min(10000, n // 10)
        t0 = time.perf_counter()
        for i in range(k):
            c = f"dev{i if i % 1000 < 940 else 0}"
            trie.replace_client(c, [(f"europe/ua/kyiv/{i}/+", Subscription(c, qos=1)),
                                    (f"europe/ua/kyiv/{i}/cmd", Subscription(c, qos=2))])
        replace_s = time.perf_counter() - t0

        clients = list(trie.clients())
        t0 = time.perf_counter()
        for c in clients:
            trie.remove_client(c)
        remove_s = time.perf_counter() - t0
        nodes_after = trie.node_count
        size_after = len(trie)
    finally:
        if freeze:
            gc.unfreeze()
    return {
        "subs": n,
        "build_per_s": n / build_s,
        "rss_mb": (rss1 - rss0) / 2**20,
        "bytes_per_sub": (rss1 - rss0) / n,
        "matches_per_s": match_count / best,
        "us_per_match": best / match_count * 1e6,
        "avg_results": total_matched / match_count,
        "match_plan_per_s": len(pubs) / plan_s,
        "replace_per_s": k / replace_s if k else 0.0,
        "remove_per_s": len(clients) / remove_s if clients else 0.0,
        "nodes_after_remove_all": nodes_after,
        "subs_after_remove_all": size_after,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tbmq_routing.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="comma list of subscription counts")
    ap.add_argument("--matches", type=int, default=200000, help="match() calls per size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after building (keeps the trie out of GC passes)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print(f"# python {platform.python_version()} ({platform.python_implementation()}), "
          f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}")
    cols = ["subs", "build_per_s", "rss_mb", "bytes_per_sub", "matches_per_s", "us_per_match",
            "avg_results", "match_plan_per_s", "replace_per_s", "remove_per_s", "nodes_after_remove_all"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for n in sizes:
        r = run(n, args.matches, args.seed, args.gc_freeze)
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:,.0f}" if isinstance(v, float) and v >= 100 else
                         f"{v:.2f}" if isinstance(v, float) else f"{v:,}")
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
