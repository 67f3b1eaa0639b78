"""The lab: what runs syncscope against real jobs, apart from what a job runs.

A training workload with stragglers injected on purpose (workload), a launcher for its ranks
(launch), emulated nodes in network namespaces (nodes), real Prometheus / Alertmanager /
exporter processes (servers), the truth pooled from the ranks' own records (truth), fabric
scenarios (scenarios), the demo, and a renderer that draws the dashboards as Grafana would
(render). The demo, the tests and the benches use it; no runtime module (agent, exporter,
monitoring, integrations) imports it.
"""
