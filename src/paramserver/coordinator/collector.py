"""CoordinatorCollector: the membership as metrics, read when the coordinator's host is scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from paramserver.coordinator.membership import Coordinator

_STATES = ("joining", "training", "finished", "exited", "dead")


class CoordinatorCollector(Collector):
    """The membership as the coordinator sees it: members by state, global step, checkpoint requests."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        view = self.coordinator.view()
        members = GaugeMetricFamily(
            "paramserver_workers", "Workers by state, as the coordinator sees them", labels=["state"]
        )
        states = list(view["states"].values())
        for state in _STATES:
            members.add_metric([state], states.count(state))
        yield members
        step = GaugeMetricFamily("paramserver_global_step", "Sum of the workers' reported steps")
        step.add_metric([], view["global_step"])
        yield step
        requested = CounterMetricFamily("paramserver_checkpoints_requested", "Checkpoints the coordinator announced")
        requested.add_metric([], view["checkpoints_requested"])
        yield requested
