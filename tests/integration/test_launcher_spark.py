"""The launcher's Spark statistics job (Suite(spark=True), `run --spark`): started after the services with
its log in the run dir, ready once its streaming query is active, stopped with the rest without leaving a JVM
or a pyspark worker behind."""

from __future__ import annotations

import json

import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


async def test_suite_runs_the_stats_job_and_stops_it_without_leftovers(make_suite):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    # latest + no publishing: the shared broker's earlier records are none of this test's business
    suite = await make_suite(services=[], spark=True, spark_args=(
        "--trigger", "processingTime=2 seconds", "--starting-offsets", "latest", "--no-publish"))
    job = suite.spark_job
    assert job is not None and job.running
    # ready = the query is active: its ready file names the job's pid, and the log says so
    info = json.loads(job.ready_file.read_text())
    assert info["pid"] == job.pid and info["query"] == "tbmq-stats"
    assert job.log_path == suite.run_dir / "logs" / "spark-stats.log"
    text = job.log_path.read_text()
    assert "stats query started" in text
    assert f"--bootstrap {suite.bootstrap_servers}" in text and f"--output {suite.run_dir / 'spark'}" in text
    assert job.pid in suite.pids() and "spark-stats" in suite.describe()

    tree = _tree(job.pid)
    assert any("java" in _cmd(p) and "SparkSubmit" in _cmd(p) for p in tree), [_cmd(p) for p in tree]
    # the query runs: its checkpoint (metadata written at the query's start) is under the run dir
    assert (suite.run_dir / "spark" / "_checkpoints" / "stats" / "metadata").is_file()

    await suite.stop()
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert alive == [], f"left behind: {[(p.pid, _cmd(p)) for p in alive]}"
    new = [p for p in me.children(recursive=True)
           if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert new == [], f"left behind: {[(p.pid, _cmd(p)) for p in new]}"
    assert not job.running and not job.ready_file.exists()
    # a graceful stop: the job's Python process handled SIGTERM (query stopped, exit code 0)
    assert job.returncode == 0, job.log_tail()
    assert "stats query stopped" in job.log_path.read_text()
