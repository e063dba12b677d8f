"""The reference server: uploads in, reference logprobs, a bounded queue, batches out, a worker registry.

Modules: queue (bounds, order, staleness), registry (workers, heartbeats), reference (the model and
its loop), app (HTTP), metrics (Prometheus), client (what the gen worker and learner use).
"""
