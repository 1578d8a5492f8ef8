"""``/health_scheduler``: a per-DP-rank scheduler health check that sends no inference request."""
