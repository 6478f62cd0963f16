"""The SparkSession every job uses.

Local runs (`--master local[2]`, the default) get Spark's Kafka source from the jars that
`infra/spark/pom.xml` fetched into infra/spark/target/jars (spark.jars, set before the first getOrCreate();
spark.jars.packages needs Ivy network access). Under spark-submit the session already exists and whatever
spark-submit was given (--jars, --py-files, --conf) is used unchanged.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from . import REPO_ROOT, SPARK_DIR

log = logging.getLogger(__name__)

DEFAULT_JARS_DIR = REPO_ROOT / "infra" / "spark" / "target" / "jars"
DEFAULT_MASTER = "local[2]"

# Settings chosen for small machines and for the jobs' semantics; a cluster may override any with --conf.
BASE_CONF: dict[str, str] = {
    # one shuffle partition per core locally; stored in the checkpoint (do not change it afterwards)
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.sql.session.timeZone": "UTC",
    # transformWithState (session/subscription projections) needs the RocksDB state store
    "spark.sql.streaming.stateStore.providerClass":
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    # the message and the session streams each have a watermark; an idle one must not hold the other back
    "spark.sql.streaming.multipleWatermarkPolicy": "max",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.streaming.noDataMicroBatches.enabled": "true",
    "spark.ui.showConsoleProgress": "false",
}

LOCAL_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.driver.memory": "1g",
    "spark.sql.adaptive.enabled": "false",
    "spark.python.worker.reuse": "true",
}


def kafka_jars(jars_dir: str | os.PathLike | None = None) -> list[str]:
    d = Path(jars_dir or os.environ.get("TBMQ_SPARK_JARS", DEFAULT_JARS_DIR))
    jars = sorted(str(p) for p in d.glob("*.jar")) if d.is_dir() else []
    if not any("spark-sql-kafka" in j for j in jars):
        raise RuntimeError(
            f"no spark-sql-kafka jar in {d}: run scripts/bootstrap.sh "
            "(mvn -q -B -f infra/spark/pom.xml dependency:copy-dependencies)")
    try:
        import pyspark

        kafka_jar = next(Path(j).name for j in jars if "spark-sql-kafka" in j)
        if not kafka_jar.endswith(f"-{pyspark.__version__}.jar"):
            log.warning("%s does not match pyspark %s (infra/spark/pom.xml spark.version = pyspark's version)",
                        kafka_jar, pyspark.__version__)
    except Exception:  # a check only
        pass
    return jars


def _python_path_for_workers() -> None:
    """Python workers are started by the JVM with its environment: make tbmq_spark importable there too
    (tbmq.v1 is installed in the venv; PYSPARK_PYTHON is this interpreter)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SPARK_DIR) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SPARK_DIR), *paths])
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def get_session(app_name: str = "tbmq-spark", master: str | None = None, *,
                conf: dict[str, str] | None = None, jars_dir: str | None = None,
                log_level: str = "WARN"):
    """The active session (spark-submit) or a new one on `master` (default local[2]) with the Kafka jars."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    _python_path_for_workers()
    builder = SparkSession.builder.appName(app_name)
    # spark-submit starts the JVM first and hands its gateway to the driver script: then master, jars and
    # py-files are spark-submit's business (--master, --jars, --py-files) and are not overridden here.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    if not submitted:
        m = master or DEFAULT_MASTER
        builder = builder.master(m)
        settings = dict(BASE_CONF)
        if m.startswith("local"):
            settings.update(LOCAL_CONF)
        settings["spark.jars"] = ",".join(kafka_jars(jars_dir))
    else:
        settings = dict(BASE_CONF)
    settings.update(conf or {})
    for k, v in settings.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    return spark


def stop_session(spark=None) -> None:
    """Stop the session and end the py4j gateway JVM that pyspark started for this process (SparkSession.stop()
    alone leaves it running until Python exits): EOF on its stdin makes it exit, then its pid is waited for."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    spark = spark or SparkSession.getActiveSession()
    if spark is not None:
        spark.stop()
    gw = SparkContext._gateway
    if gw is None:
        return
    proc = getattr(gw, "proc", None)
    try:
        gw.shutdown()
    except Exception:
        pass
    if proc is not None:
        try:
            proc.stdin.close()
            proc.wait(timeout=15)
        except Exception:
            proc.kill()
            proc.wait()
    SparkContext._gateway = None
    SparkContext._jvm = None
