"""A metrics endpoint's samples as prometheus_client's own parser reads them."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str) -> dict:
    """{(sample name, sorted labels): value} of a metrics endpoint, parsed by prometheus_client."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]
