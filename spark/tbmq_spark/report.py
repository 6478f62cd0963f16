"""Report: PNG charts and a short text summary from the statistics Parquet (<output>/stats).

    messages.png   incoming / outgoing messages per second, per window
    sessions.png   sessions connected, persistent sessions and subscriptions at each window's end
    summary.txt    totals, peaks and the last gauges (also returned as a string)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd


@dataclass
class ReportResult:
    charts: list[str]
    summary_path: str
    summary: str


def load_stats(stats_path: str) -> pd.DataFrame:
    """The stats Parquet (all batch_id partitions) as pandas, read with pyarrow (no Spark needed).
    A window appears in exactly one batch; should a replay have produced it twice, the latest wins."""
    import pyarrow.dataset as ds

    if not os.path.isdir(stats_path):
        return pd.DataFrame(columns=["window_start", "window_end", "metric", "dimension", "value", "kind"])
    df = ds.dataset(stats_path, format="parquet", partitioning="hive").to_table().to_pandas()
    if df.empty:
        return df
    df["batch_id"] = df["batch_id"].astype(int)
    latest = df.groupby("window_start")["batch_id"].transform("max")
    return df[df["batch_id"] == latest].drop(columns=["batch_id"]).sort_values(["window_start", "metric"])


def _series(df: pd.DataFrame, metric: str, dimension: str = "") -> pd.Series:
    sel = df[(df["metric"] == metric) & (df["dimension"] == dimension)]
    return sel.set_index("window_start")["value"].sort_index()


def render(output: str, out_dir: str | None = None) -> ReportResult:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    stats = load_stats(os.path.join(output, "stats"))
    out_dir = out_dir or os.path.join(output, "report")
    os.makedirs(out_dir, exist_ok=True)
    charts = []
    if stats.empty:
        summary = "tbmq-py usage report\nno statistics windows yet (run `python -m tbmq_spark stats` first)\n"
    else:
        secs = (stats["window_end"] - stats["window_start"]).dt.total_seconds().iloc[0]
        idx = pd.DatetimeIndex(sorted(stats["window_start"].unique()))
        inc = _series(stats, "incoming_msgs").reindex(idx, fill_value=0)
        out = _series(stats, "outgoing_msgs").reindex(idx, fill_value=0)

        fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
        ax.plot(idx, inc / secs, marker="o", label="incoming msg/s")
        ax.plot(idx, out / secs, marker="s", label="outgoing msg/s")
        ax.set_title(f"Message rates per {int(secs)} s window")
        ax.set_ylabel("messages / s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        fig.autofmt_xdate()
        p = os.path.join(out_dir, "messages.png")
        fig.savefig(p)
        plt.close(fig)
        charts.append(p)

        fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
        for metric, label in (("sessions_connected", "connected sessions"),
                              ("sessions_persistent", "persistent sessions"),
                              ("subscriptions", "subscriptions")):
            s = _series(stats, metric).reindex(idx).ffill().fillna(0)
            ax.step(idx, s, where="post", label=label)
        ax.set_title("Sessions and subscriptions at window end")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        fig.autofmt_xdate()
        p = os.path.join(out_dir, "sessions.png")
        fig.savefig(p)
        plt.close(fig)
        charts.append(p)

        def total(metric):
            return int(_series(stats, metric).sum())

        def last(metric):
            s = _series(stats, metric)
            return int(s.iloc[-1]) if len(s) else 0

        peak_at = inc.idxmax()
        lines = [
            "tbmq-py usage report",
            f"windows: {len(idx)} of {int(secs)} s, {idx[0]:%Y-%m-%d %H:%M} .. {idx[-1]:%Y-%m-%d %H:%M} UTC",
            f"incoming: {total('incoming_msgs')} messages, {total('incoming_bytes')} bytes; "
            f"peak {int(inc.max())} in the window at {peak_at:%H:%M} ({inc.max() / secs:.2f} msg/s)",
            f"outgoing: {total('outgoing_msgs')} messages, {total('outgoing_bytes')} bytes",
            f"connects: {total('connects')}, disconnects: {total('disconnects')}",
            f"now: {last('sessions_connected')} connected sessions, {last('sessions_persistent')} persistent "
            f"sessions, {last('subscriptions')} subscriptions",
        ]
        by_qos = stats[(stats["metric"] == "incoming_msgs") & stats["dimension"].str.startswith("qos=")]
        if not by_qos.empty:
            q = by_qos.groupby("dimension")["value"].sum()
            lines.append("incoming by QoS: " + ", ".join(f"{k}: {int(v)}" for k, v in q.items()))
        summary = "\n".join(lines) + "\n"
    summary_path = os.path.join(out_dir, "summary.txt")
    with open(summary_path, "w") as f:
        f.write(summary)
    return ReportResult(charts=charts, summary_path=summary_path, summary=summary)
