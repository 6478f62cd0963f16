"""Driver script for spark-submit (a cluster, or local): the same jobs and arguments as python -m tbmq_spark.

    spark-submit --master spark://host:7077 \
      --jars "$(ls infra/spark/target/jars/*.jar | paste -sd,)" \
      --py-files dist/tbmq_spark.zip \
      spark/submit.py stats --bootstrap kafka:9092 --output hdfs:///tbmq/spark

See docs/spark.md.
"""

import sys

from tbmq_spark.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
