"""The lab: what runs syncscope against real jobs, apart from what a job runs.

A training workload with stragglers injected on purpose (workload), a launcher for its ranks
(launch), emulated nodes in network namespaces (nodes), real Prometheus / Alertmanager /
VictoriaMetrics / vmalert / exporter processes (servers), promtool's rule tests as data
(promtool_cases) and their replay through vmalert (vmreplay), the truth pooled from the
ranks' own records (truth), fabric scenarios (scenarios), the demo, a renderer that draws the
dashboards as Grafana would (render), and the benches' statistics (stats) and frame counts
(frames). The demo, the tests and the benches use it; no runtime module (agent, exporter,
monitoring, integrations) imports it.
"""
