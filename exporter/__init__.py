"""Node sidecar: aggregates the local ranks' reports and serves them as Prometheus metrics."""
