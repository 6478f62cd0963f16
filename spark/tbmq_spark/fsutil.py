"""Small text files on whatever file system a path names (local, hdfs://, s3a://), through Spark's
Hadoop FileSystem, so the driver-side state works the same on a laptop and on a cluster."""

from __future__ import annotations


def _fs(spark, path: str):
    jvm = spark.sparkContext._jvm
    p = jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), p, jvm


def list_names(spark, directory: str) -> list[str]:
    fs, p, _ = _fs(spark, directory)
    if not fs.exists(p):
        return []
    return [st.getPath().getName() for st in fs.listStatus(p)]


def read_text(spark, path: str) -> str:
    fs, p, jvm = _fs(spark, path)
    stream = fs.open(p)
    try:
        return jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
    finally:
        stream.close()


def write_text(spark, path: str, text: str) -> None:
    """Write to a temporary name, then rename over the target (replaces an older copy)."""
    fs, p, jvm = _fs(spark, path)
    tmp = jvm.org.apache.hadoop.fs.Path(p.getParent(), "." + p.getName() + ".tmp")
    out = fs.create(tmp, True)
    try:
        out.write(bytearray(text.encode("utf-8")))
    finally:
        out.close()
    if fs.exists(p):
        fs.delete(p, False)
    fs.rename(tmp, p)


def delete_older(spark, directory: str, below: int) -> None:
    """Delete <directory>/<n>.json for n < below."""
    fs, p, jvm = _fs(spark, directory)
    for name in list_names(spark, directory):
        stem = name[:-5] if name.endswith(".json") else ""
        if stem.isdigit() and int(stem) < below:
            fs.delete(jvm.org.apache.hadoop.fs.Path(p, name), False)


def delete(spark, path: str) -> bool:
    """Delete one file; False when it was not there."""
    fs, p, _ = _fs(spark, path)
    return bool(fs.delete(p, False)) if fs.exists(p) else False
