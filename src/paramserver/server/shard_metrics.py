"""A shard's counters as Prometheus metrics, read from Shard.describe() and TableStore.describe() when
scraped (nothing is counted twice, nothing is added to the push path). Names: docs/operations.md."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from paramserver.server.shard import Shard
from paramserver.tables.table_store import TableStore

# a table's describe() counter -> (metric name without _total, help)
_TABLE_COUNTERS = {
    "updates": ("paramserver_table_updates", "Row-wise optimizer steps of a table"),
    "admitted": ("paramserver_table_admissions", "Ids admitted as rows of a table"),
    "not_admitted_lookups": (
        "paramserver_table_not_admitted_lookups",
        "Lookups of ids the admission policy did not admit (yet)",
    ),
    "dropped_gradients": ("paramserver_table_dropped_gradients", "Row gradients dropped (their id holds no row)"),
    "evicted": ("paramserver_table_evictions", "Rows evicted from a table"),
}

# a tiered table's describe() figures (docs/scaling.md) -> (metric name, help): gauges, then counters
_TIER_GAUGES = {
    "memory_rows": ("paramserver_table_memory_rows", "Rows of a tiered table held in memory on this shard"),
    "disk_rows": ("paramserver_table_disk_rows", "Rows of a tiered table on this shard's spill disk"),
    "disk_bytes": ("paramserver_table_disk_bytes", "Bytes of a tiered table's files on this shard's spill disk"),
}
_TIER_COUNTERS = {
    "disk_reads": ("paramserver_table_disk_reads", "Rows of a tiered table read from the spill disk"),
    "disk_writes": ("paramserver_table_disk_writes", "Rows of a tiered table written to the spill disk"),
}


class ShardCollector(Collector):
    """The metrics of one shard and its tables (labels: `shard`, and `table` for a table's)."""

    def __init__(self, shard: Shard, tables: TableStore) -> None:
        self.shard = shard
        self.tables = tables

    def collect(self) -> Iterator[Metric]:
        shard, label = self.shard.describe(), [str(self.shard.index)]
        for name, help_text, value in (
            ("paramserver_pushes", "Pushes received", shard["pushes"]),
            ("paramserver_updates_applied", "Updates applied to the shard's variables (its version)", shard["version"]),
            (
                "paramserver_pushes_dropped_late",
                "Late sync pushes dropped (their step was applied without them)",
                shard["dropped_late"],
            ),
            ("paramserver_sync_steps", "Sync steps applied", shard["sync_step"]),
        ):
            family = CounterMetricFamily(name, help_text, labels=["shard"])
            family.add_metric(label, value)
            yield family
        for name, help_text, value in (
            ("paramserver_staleness_max", "Largest staleness of a push (updates behind)", shard["staleness_max"]),
            ("paramserver_staleness_mean", "Mean staleness of the pushes (updates behind)", shard["staleness_mean"]),
            ("paramserver_pushes_waiting", "Pushes blocked in a sync step or an ssp bound now", shard["waiting"]),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["shard"])
            gauge.add_metric(label, value)
            yield gauge
        yield from self._tables(label[0])

    def _tables(self, shard: str) -> Iterator[Metric]:
        tables = self.tables.describe()
        rows = GaugeMetricFamily(
            "paramserver_table_rows", "Rows a table holds on this shard", labels=["shard", "table"]
        )
        size = GaugeMetricFamily(
            "paramserver_table_bytes",
            "Bytes of a table on this shard (values, optimizer state, index)",
            labels=["shard", "table"],
        )
        counters = {
            key: CounterMetricFamily(name, help_text, labels=["shard", "table"])
            for key, (name, help_text) in _TABLE_COUNTERS.items()
        }
        for table, described in tables.items():
            rows.add_metric([shard, table], described["rows"])
            size.add_metric([shard, table], described["bytes"])
            for key, family in counters.items():
                family.add_metric([shard, table], described.get(key, 0))
        yield rows
        yield size
        yield from counters.values()
        yield from self._tiers(shard, tables)

    def _tiers(self, shard: str, tables: dict[str, dict]) -> Iterator[Metric]:
        """The tiered tables' figures, when the shard has tiered tables."""
        tiered = {name: described for name, described in tables.items() if "disk_rows" in described}
        if not tiered:
            return
        for figures, family in ((_TIER_GAUGES, GaugeMetricFamily), (_TIER_COUNTERS, CounterMetricFamily)):
            for key, (name, help_text) in figures.items():
                metric = family(name, help_text, labels=["shard", "table"])
                for table, described in tiered.items():
                    metric.add_metric([shard, table], described[key])
                yield metric
