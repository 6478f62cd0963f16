"""The report command renders PNG charts and a summary from the statistics Parquet."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_report_renders_pngs(stats_run, tmp_path):
    from PIL import Image, ImageStat

    from tbmq_spark.report import render

    res = render(stats_run.output, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in res.charts] == ["messages.png", "sessions.png"]
    for path in res.charts:
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size == (1000, 400)
            rgb = im.convert("RGB")
            # not blank: many colours and real variance (axes, lines, labels)
            assert len(rgb.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20
            assert max(ImageStat.Stat(rgb).stddev) > 10
    assert "incoming:" in res.summary and "connects:" in res.summary
    assert (tmp_path / "summary.txt").read_text() == res.summary
