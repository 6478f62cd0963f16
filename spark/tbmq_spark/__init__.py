"""tbmq-py Spark jobs (see docs/spark.md).

    python -m tbmq_spark stats   --bootstrap localhost:9092 --output .run/spark   # streaming statistics
    python -m tbmq_spark archive --bootstrap localhost:9092 --output .run/spark   # event log + rebuild check
    python -m tbmq_spark report  --output .run/spark                               # PNG charts + summary

The same modules run unchanged under spark-submit (spark/submit.py is the driver script).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SPARK_DIR = PACKAGE_DIR.parent            # spark/ (holds tbmq_spark/)
REPO_ROOT = SPARK_DIR.parent
SOURCE = "spark-stats"                    # UsageStats.source
