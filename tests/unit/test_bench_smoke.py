"""One quick end-to-end run of the harness: p2p for ~2 s against a real Mosquitto started by the bench.

It checks the harness, not performance: nothing lost or duplicated, every message accounted for, numbers
that are internally consistent, and the JSON + PNG written. No timing thresholds on the broker."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cli import main  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                                reason="mosquitto is not installed")


@pytest.mark.timeout(120)
def test_p2p_smoke_against_mosquitto(tmp_path, capsys):
    rc = main(["--brokers", "mosquitto", "--scenarios", "p2p", "--quick", "--search", "none", "--layout", "one-core",
               "--broker-warmup", "0", "--idle-warmup", "0", "--idle-window", "0.5", "--cooldown-max", "2",
               "--duration", "2", "--pairs", "5", "--rate", "p2p=200", "--out", str(tmp_path)])
    assert rc == 0
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 1 and files[0].with_suffix(".png").exists()
    doc = json.loads(files[0].read_text())
    run = doc["layouts"]["one-core"]
    assert run["layout"] == "one-core" and "idle" in run["brokers"]["mosquitto"]
    r = run["results"]["p2p"]["mosquitto"]
    assert "error" not in r, r
    f = r["fixed"]
    assert f["lost"] == 0 and f["dup"] == 0 and f["disconnects"] == 0 and f["unacked"] == 0
    assert f["sent"] == f["expected"] > 0
    # 200/s for 2 s (+ warm-up): the generator really sent about that, and all of it came out
    assert 150 <= f["in_rate"] <= 250
    assert 150 <= f["out_rate"] <= 250
    e2e = f["e2e_ms"]
    assert e2e["count"] > 300
    assert 0 <= e2e["p50"] <= e2e["p95"] <= e2e["p99"] <= e2e["max"]
    assert not math.isnan(f["puback_ms"]["p99"])
    assert "mosquitto" in f["processes"] and any(k.startswith("generator-") for k in f["processes"])
    assert f["processes"]["mosquitto"]["rss_mb"] > 0
    assert f["us_per_msg"]["mosquitto"] == f["us_per_msg"]["total"] >= 0
    assert f["cooldown"] is not None and f["cooldown"]["waited_s"] >= 0
    assert r["fixed_steps"] == [f]
    out = capsys.readouterr().out
    assert "e2e p99 ms" in out and "mosquitto" in out


@pytest.mark.timeout(120)
def test_held_connections_smoke_against_mosquitto(tmp_path, capsys):
    rc = main(["--brokers", "mosquitto", "--scenarios", "connections", "--quick", "--search", "none", "--layout",
               "whole", "--broker-warmup", "0", "--idle-warmup", "0", "--idle-window", "0.5", "--cooldown-max", "2",
               "--connections", "300", "--hold-window", "0.5", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads(sorted(tmp_path.glob("*.json"))[0].read_text())
    r = doc["layouts"]["whole"]["results"]["connections"]["mosquitto"]
    assert "error" not in r, r
    assert r["connected"] == r["open_at_end"] == 300 and r["errors"] == 0 and r["ok"]
    # each of the 300 holds a socket, a session and a subscription: the broker's RSS grew, and the bytes per
    # connection are that growth shared out
    growth = r["rss_held_mb"]["mosquitto"] - r["rss_before_mb"]["mosquitto"]
    assert growth > 0 and r["bytes_per_conn"]["mosquitto"] == r["bytes_per_conn"]["total"] > 0
    assert abs(r["bytes_per_conn"]["total"] * 300 / 2**20 - growth) < 0.11  # MB figures are rounded to 0.1
    assert "held connections, per process" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_interleaved_p2p_takes_turns_at_each_rate(tmp_path, capsys):
    """Two real brokers started at once: at each fixed rate Mosquitto's step, then amqtt's; each step's CPU is
    that broker's processes only, though the other runs beside it; the scenario listed before p2p runs per
    broker before the turns."""
    rc = main(["--brokers", "mosquitto,amqtt", "--scenarios", "connections,p2p", "--quick", "--search", "none",
               "--layout", "whole", "--broker-warmup", "0", "--idle-warmup", "0", "--idle-window", "0.5",
               "--cooldown-max", "2", "--duration", "2", "--pairs", "5", "--rate", "p2p=100,200",
               "--connections", "50", "--hold-window", "0.5", "--out", str(tmp_path)])
    assert rc == 0
    run = json.loads(sorted(tmp_path.glob("*.json"))[0].read_text())["layouts"]["whole"]
    assert run["interleaved"] == ["p2p"]
    p2p = run["results"]["p2p"]
    steps = {b: p2p[b]["fixed_steps"] for b in ("mosquitto", "amqtt")}
    for b, own, other in (("mosquitto", "mosquitto", "amqtt"), ("amqtt", "amqtt", "mosquitto")):
        assert "error" not in p2p[b], p2p[b]
        assert p2p[b]["params"]["interleaved"] is True
        assert [st["rate"] for st in steps[b]] == [100, 200]
        for st in steps[b]:
            assert st["lost"] == 0 and st["sent"] == st["expected"] > 0
            assert own in st["processes"] and other not in st["processes"]
            assert st["us_per_msg"][own] == st["us_per_msg"]["total"]
    order = sorted((st["started_at"], b, st["rate"]) for b, sts in steps.items() for st in sts)
    assert [(b, r) for _, b, r in order] == [("mosquitto", 100), ("amqtt", 100), ("mosquitto", 200), ("amqtt", 200)]
    for b in ("mosquitto", "amqtt"):
        held = run["results"]["connections"][b]
        assert "error" not in held and held["connected"] == 50, held
    assert "took turns at each rate" in capsys.readouterr().out
