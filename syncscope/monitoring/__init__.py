"""Prometheus rules, Prometheus configs and Grafana dashboards, generated from one thresholds file.

The rules also for vmalert (VictoriaMetrics): `engines` adapts them per rule engine.

Shipped with the package, so `syncscope rules` and `syncscope dashboards --out DIR` work from an
installed wheel; the copies under deploy/ and dashboards/ of the checkout are this package's
output (`syncscope generate`), kept current by a test.
"""
