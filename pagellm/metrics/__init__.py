"""Serving metrics: per-request timing and per-step counts (stats), Prometheus export, the periodic stats log."""
