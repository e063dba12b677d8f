"""Prometheus exposition of the same numbers /stats reports (read at scrape time: one source of truth).

Each app gets its own CollectorRegistry, so several servers in one process (tests) do not collide.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# (stats path, metric name, kind, help)
_METRICS = [
    (("queue", "samples"), "toolrl_ref_queue_samples", "gauge", "Samples held (pending, computing and ready)"),
    (("queue", "bytes"), "toolrl_ref_queue_bytes", "gauge", "Estimated bytes held by queued samples"),
    (("queue", "pending"), "toolrl_ref_queue_pending", "gauge", "Samples waiting for reference logprobs"),
    (("queue", "ready"), "toolrl_ref_queue_ready", "gauge", "Samples ready for the learner"),
    (("queue", "max_samples"), "toolrl_ref_queue_max_samples", "gauge", "Queue bound in samples"),
    (("queue", "max_bytes"), "toolrl_ref_queue_max_bytes", "gauge", "Queue bound in bytes"),
    (("queue", "learner_version"), "toolrl_ref_learner_version", "gauge", "Learner policy version"),
    (("queue", "samples_in"), "toolrl_ref_samples_in", "counter", "Samples accepted"),
    (("queue", "samples_out"), "toolrl_ref_samples_out", "counter", "Samples delivered to the learner"),
    (("queue", "dropped_stale"), "toolrl_ref_dropped_stale", "counter", "Samples dropped as stale"),
    (("queue", "dropped_failed"), "toolrl_ref_dropped_failed", "counter", "Samples the reference failed on"),
    (("queue", "rejected_full"), "toolrl_ref_uploads_full", "counter", "Uploads answered 503 (queue full)"),
    (("queue", "waited_full"), "toolrl_ref_uploads_waited", "counter", "Uploads that waited for space"),
    (("http", "uploads_rejected"), "toolrl_ref_uploads_rejected", "counter",
     "Uploads rejected (400): malformed, or a sample refused"),
    (("http", "uploads_too_large"), "toolrl_ref_uploads_too_large", "counter", "Uploads rejected as too large (413)"),
    (("http", "uploads_timed_out"), "toolrl_ref_uploads_timed_out", "counter",
     "Uploads whose body did not arrive within body_timeout_s (408)"),
    (("http", "uploads_busy"), "toolrl_ref_uploads_busy", "counter",
     "Uploads answered 503 for body bytes or decode slots"),
    (("http", "uploads_ahead_of_learner"), "toolrl_ref_uploads_ahead", "counter",
     "Uploads answered 503: a policy version the learner has not announced yet"),
    (("reference", "tokens_total"), "toolrl_ref_tokens", "counter", "Tokens scored by the reference"),
    (("reference", "compute_s_total"), "toolrl_ref_compute_seconds", "counter", "Reference compute time"),
    (("reference", "tokens_per_s_last_60s"), "toolrl_ref_tokens_per_second", "gauge",
     "Reference tokens/s over the last 60 s"),
    (("stale_drop_fraction",), "toolrl_ref_stale_drop_fraction", "gauge",
     "Stale drops over policy samples received"),
    (("flow", "limit"), "toolrl_ref_flow_limit", "gauge",
     "Flow bound: samples queued plus generating the learner can still use"),
    (("flow", "in_flight"), "toolrl_ref_flow_in_flight", "gauge", "Samples granted and still generating"),
    (("flow", "grants"), "toolrl_ref_flow_grants", "gauge", "Grants held"),
    (("flow", "granted_total"), "toolrl_ref_flow_granted", "counter", "Grants given"),
    (("flow", "refused_total"), "toolrl_ref_flow_refused", "counter", "Grant requests refused (no room)"),
    (("flow", "released_total"), "toolrl_ref_flow_released", "counter", "Grants ended by an upload or given back"),
    (("flow", "expired_total"), "toolrl_ref_flow_expired", "counter", "Grants taken back when their lease ran out"),
    (("workers", "live"), "toolrl_ref_workers_live", "gauge", "Live registered gen workers"),
    (("workers", "expired_total"), "toolrl_ref_workers_expired", "counter", "Workers dropped for missed heartbeats"),
]


class _StatsCollector:
    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        snap = self.stats()
        for path, name, kind, doc in _METRICS:
            value = snap
            for key in path:
                value = value.get(key, {}) if isinstance(value, dict) else {}
            if not isinstance(value, (int, float)):
                continue
            family = CounterMetricFamily(name, doc) if kind == "counter" else GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family


def metrics_registry(stats: Callable[[], dict]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
