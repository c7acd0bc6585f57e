"""A trivial job for spark-submit: Python tasks on the executors, one line of output to check."""

from __future__ import annotations

import sys

from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()  # spark-submit's settings: master, jars, conf
sc = spark.sparkContext
total = sc.parallelize(range(1, 101), 4).map(lambda x: x * x).sum()
(executor_python,) = set(sc.parallelize(range(4), 4).map(lambda _: sys.executable).collect())
print(f"RESULT master={sc.master} sum={total} executor_python={executor_python}", flush=True)
spark.stop()
