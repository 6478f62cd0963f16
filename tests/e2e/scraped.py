"""GET /metrics of a service, parsed with prometheus-client's own parser: `scrape(port)` -> {sample name: samples},
`value(samples, name, **labels)` -> the sum of the samples with those labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from tbmq_launcher.services import http_get


async def scrape(port: int) -> dict[str, list]:
    status, body = await http_get("127.0.0.1", port, "/metrics", timeout=5)
    assert status == 200
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(samples: dict, name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))
