"""Observability: build info, per-feature bound gauges, pre-created series, scheduler-loop phase
metrics, the Grafana overview dashboard generator and ``dspark-harden metrics-lint``.

See docs/observability.md and docs/metrics.md.
"""
