"""Deployment files: compose, Dockerfiles, Alertmanager, Grafana provisioning and Kubernetes manifests.

No Docker engine or cluster runs here, so these are offline checks: schemas (compose spec,
Kubernetes API schemas), amtool, and structural asserts that the pieces point at each other.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from syncscope.monitoring import rules
from syncscope.thresholds import load_config

yaml = pytest.importorskip("yaml", reason="PyYAML missing: run scripts/install-observability-tools")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSION = "1.30.0"  # native sidecars (restartPolicy on an init container) need 1.29+


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def tool(name: str) -> str:
    """On PATH, or beside this interpreter (a virtualenv's bin/ need not be on PATH)."""
    beside = Path(sys.executable).parent / name
    path = shutil.which(name) or (str(beside) if beside.exists() else None)
    if path is None:
        pytest.skip(f"{name} not installed: run scripts/install-observability-tools")
    return path


# ------------------------------------------------------------------------------- compose


@pytest.mark.parametrize(
    "path", ["docker-compose.yml", "deploy/victoriametrics/compose.yml"], ids=["prometheus", "vm"]
)
def test_compose_validates_against_the_compose_spec(path):
    result = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(ROOT / path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_wires_the_stack_together():
    services = compose()["services"]
    assert set(services) == {"exporter", "trainer", "prometheus", "alertmanager", "grafana"}
    assert services["exporter"]["command"][:2] == ["--host", "0.0.0.0"]
    assert services["trainer"]["environment"]["SYNCSCOPE_EXPORTER"] == "http://exporter:9464"
    assert services["exporter"]["build"]["dockerfile"] == "deploy/docker/Dockerfile.exporter"
    assert services["trainer"]["build"]["dockerfile"] == "deploy/docker/Dockerfile.trainer"
    prom_cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom_cfg["scrape_configs"][0]["static_configs"][0]["targets"] == ["exporter:9464"]
    assert prom_cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        "alertmanager:9093"
    ]
    grafana_ds = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/syncscope.yml").read_text()
    )
    assert grafana_ds["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/syncscope.yml").read_text()
    )
    dash_path = provider["providers"][0]["options"]["path"]
    mounted = [
        v.split(":")[1] for v in services["grafana"]["volumes"] if v.startswith("./dashboards/")
    ]
    assert sorted(mounted) == sorted(
        f"{dash_path}/{p.name}" for p in (ROOT / "dashboards").glob("syncscope-*.json")
    )


def test_every_compose_bind_mount_exists():
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source}"


# --------------------------------------------------------------------------- Dockerfiles


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


@pytest.mark.parametrize("name", ["Dockerfile.exporter", "Dockerfile.trainer"])
def test_dockerfile_copies_what_exists(name):
    ins = _instructions(DEPLOY / "docker" / name)
    assert ins[0][0] == "FROM"
    assert ("USER", "10001") in ins
    for op, arg in ins:
        if op == "COPY" and not arg.startswith("--from"):
            *sources, _dest = arg.split()
            for source in sources:
                if source == "README.md" and not (ROOT / source).exists():
                    continue  # the project README is written by the lead; pyproject needs it
                assert (ROOT / source).exists(), f"{name}: COPY {source}"


def test_exporter_image_has_no_torch_and_listens_beyond_loopback():
    ins = _instructions(DEPLOY / "docker" / "Dockerfile.exporter")
    runs = " ".join(arg for op, arg in ins if op == "RUN")
    assert "pip install ." in runs and "torch" not in runs
    assert ("ENTRYPOINT", '["syncscope-exporter"]') in ins
    assert ("CMD", '["--host", "0.0.0.0", "--port", "9464"]') in ins


def test_trainer_image_runs_the_workload_under_torchrun():
    ins = _instructions(DEPLOY / "docker" / "Dockerfile.trainer")
    runs = " ".join(arg for op, arg in ins if op == "RUN")
    assert '".[torch]"' in runs
    (cmd,) = [arg for op, arg in ins if op == "CMD"]
    assert "torchrun" in cmd and "-m syncscope.lab.workload" in cmd
    assert any(op == "ENV" and "SYNCSCOPE_EXPORTER=http://exporter:9464" in arg for op, arg in ins)


# -------------------------------------------------------------------------- Alertmanager


def test_alertmanager_config_passes_amtool():
    result = subprocess.run(
        [tool("amtool"), "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alertmanager_inhibitions_name_real_alerts():
    am = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    alerts = {r["alert"] for r in rules.alerting_rules(load_config())}
    for rule in am["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            m = re.fullmatch(r'alertname=~?"([^"]+)"', matcher)
            if m:
                named = set(m.group(1).split("|"))
                assert named <= alerts, named - alerts


# ---------------------------------------------------------------------------- Kubernetes


def manifests() -> dict[Path, dict]:
    return {p: yaml.safe_load(p.read_text()) for p in sorted(K8S.rglob("*.yaml"))}


def by_kind(kind: str, variant: str) -> dict:
    (doc,) = [d for p, d in manifests().items() if d["kind"] == kind and p.parent.name == variant]
    return doc


def test_builtin_kinds_validate_strictly_against_the_kubernetes_schema():
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate missing: run scripts/install-observability-tools",
    )
    checked = 0
    for doc in manifests().values():
        if doc["apiVersion"].startswith(
            ("monitoring.coreos.com", "operator.victoriametrics.com", "kustomize.config.k8s.io")
        ):
            continue  # CRDs: no bundled schema; structural checks below
        kv.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked == 5  # Namespace, two Jobs, DaemonSet, Service
    # The check would catch a typo.
    job = by_kind("Job", "sidecar")
    job["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(job, K8S_VERSION, strict=True)


def test_kustomizations_list_existing_files():
    for path, doc in manifests().items():
        if doc["kind"] == "Kustomization":
            for resource in doc["resources"]:
                assert (path.parent / resource).exists(), f"{path}: {resource}"


def _exporter_selector_regex() -> str:
    selector = load_config().selectors.exporter
    match = re.fullmatch(r'job=~"(.+)"', selector)
    assert match, selector
    return match.group(1)


def test_sidecar_variant_is_scraped_by_its_podmonitor():
    job, pm = by_kind("Job", "sidecar"), by_kind("PodMonitor", "sidecar")
    pod = job["spec"]["template"]
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: the Job can still complete
    assert sidecar["args"][:2] == ["--host", "0.0.0.0"]
    trainer = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["SYNCSCOPE_EXPORTER"] == "http://127.0.0.1:9464"
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True
    assert endpoint["port"] in {p["name"] for p in sidecar["ports"]}
    # The Operator names the job <namespace>/<name>; the alerts' selector must match it.
    job_label = f"{pm['metadata']['namespace']}/{pm['metadata']['name']}"
    assert re.fullmatch(_exporter_selector_regex(), job_label)


def test_daemonset_variant_is_scraped_through_its_service():
    ds, svc = by_kind("DaemonSet", "daemonset"), by_kind("Service", "daemonset")
    sm, job = by_kind("ServiceMonitor", "daemonset"), by_kind("Job", "daemonset")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["clusterIP"] == "None"
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["--host", "0.0.0.0"]
    port_names = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert re.fullmatch(_exporter_selector_regex(), svc["metadata"]["name"])
    hostport = container["ports"][0]["hostPort"]
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["SYNCSCOPE_EXPORTER"]["value"] == f"http://$(HOST_IP):{hostport}"


def test_operator_objects_share_one_namespace_and_the_release_label():
    for _path, doc in manifests().items():
        if doc["apiVersion"].startswith("monitoring.coreos.com"):
            assert doc["metadata"]["namespace"] == "syncscope"
            assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# ------------------------------------------------- beyond one Prometheus: VictoriaMetrics

VM = DEPLOY / "victoriametrics"


def vm_compose() -> dict:
    return yaml.safe_load((VM / "compose.yml").read_text())


def test_victoriametrics_compose_shards_the_scrape_and_points_everything_at_one_store():
    services = vm_compose()["services"]
    shards = sorted(name for name in services if name.startswith("vmagent-"))
    assert len(shards) >= 2, shards
    vm = "http://victoria-metrics:8428"
    for i, name in enumerate(shards):
        flags = dict(arg.lstrip("-").split("=", 1) for arg in services[name]["command"])
        assert flags["promscrape.cluster.memberNum"] == str(i)
        assert flags["promscrape.cluster.membersCount"] == str(len(shards))
        assert flags["promscrape.config"] == "/etc/vmagent/vmagent.yml"
        assert flags["remoteWrite.url"] == vm + "/api/v1/write"
    alert = dict(arg.lstrip("-").split("=", 1) for arg in services["vmalert"]["command"])
    assert alert["datasource.url"] == alert["remoteWrite.url"] == alert["remoteRead.url"] == vm
    assert alert["notifier.url"] == "http://alertmanager:9093"
    assert services["exporter"]["command"][-2:] == ["--prometheus-url", vm]
    datasource = yaml.safe_load((VM / "grafana-datasource.yml").read_text())
    assert datasource["datasources"][0]["url"] == vm
    scrape = yaml.safe_load((VM / "vmagent.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["exporter:9464"]
    assert "rule_files" not in scrape  # vmagent refuses Prometheus's rule keys
    for name, service in services.items():  # every bind mount exists, relative to the file
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (VM / source).exists(), f"{name}: {source}"
    rules_mount = next(v for v in services["vmalert"]["volumes"] if v.startswith("./rules"))
    assert (VM / "rules" / "syncscope.rules.yml").exists(), rules_mount


def test_both_compose_files_pin_the_same_images_for_the_services_they_share():
    # The root compose file is written by hand and the VictoriaMetrics one generated: an image
    # upgraded in one must not leave the other behind.
    root, vm = compose()["services"], vm_compose()["services"]
    shared = sorted(set(root) & set(vm))
    assert {"exporter", "trainer", "alertmanager", "grafana"} <= set(shared), shared
    assert {name: vm[name]["image"] for name in shared} == {
        name: root[name]["image"] for name in shared
    }


def test_the_victoriametrics_deployments_are_sized_for_100k_ranks():
    """At 100,000 ranks VictoriaMetrics' default -search.maxUniqueTimeseries (300,000) refuses
    the phase shares' rate (a series per phase and rank), and vmalert's default
    -remoteWrite.maxQueueSize (100,000) drops the records of the rules that keep the rank label
    (up to one per rank each). Both files set each above what the shipped rules need."""
    from syncscope.wire import PHASES

    ranks = 100_000
    vmalert_rules = yaml.safe_load((VM / "rules" / "syncscope.rules.yml").read_text())
    per_rank = [
        r["record"]
        for g in vmalert_rules["groups"]
        for r in g["rules"]
        if "record" in r and r["record"].split(":")[0] in ("job_rank", "job_rank_fault")
    ]
    assert len(per_rank) >= 4, per_rank  # the straggler's and the locality's, at least
    need = {
        "search.maxUniqueTimeseries": len(PHASES) * ranks,
        "remoteWrite.maxQueueSize": len(per_rank) * ranks,
    }
    services = vm_compose()["services"]
    compose_flags = {
        "search.maxUniqueTimeseries": services["victoria-metrics"]["command"],
        "remoteWrite.maxQueueSize": services["vmalert"]["command"],
    }
    objects = {d["kind"]: d for p, d in manifests().items() if p.parent.name == "victoriametrics"}
    operator = {
        "search.maxUniqueTimeseries": objects["VMSingle"]["spec"]["extraArgs"],
        "remoteWrite.maxQueueSize": objects["VMAlert"]["spec"]["extraArgs"],
    }
    for flag, least in need.items():
        args = dict(a.lstrip("-").split("=", 1) for a in compose_flags[flag])
        assert int(args[flag]) >= least, (flag, args.get(flag), least)
        assert int(operator[flag][flag]) == int(args[flag]), (flag, operator[flag])


def test_vmagent_accepts_the_shards_scrape_config():
    if shutil.which("vmagent") is None:
        pytest.skip("vmagent not installed (scripts/setup test installs victoria-metrics)")
    result = subprocess.run(
        ["vmagent", "-dryRun", f"-promscrape.config={VM / 'vmagent.yml'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_victoriametrics_operator_objects_select_each_other():
    objects = {d["kind"]: d for p, d in manifests().items() if p.parent.name == "victoriametrics"}
    assert set(objects) == {
        "VMSingle",
        "VMAgent",
        "VMAlert",
        "VMRule",
        "VMServiceScrape",
        "VMPodScrape",
        "Kustomization",
    }
    agent, alert = objects["VMAgent"]["spec"], objects["VMAlert"]["spec"]
    assert agent["shardCount"] >= 2 and agent["selectAllByDefault"] is False
    labels = objects["VMServiceScrape"]["metadata"]["labels"]
    assert agent["serviceScrapeSelector"]["matchLabels"].items() <= labels.items()
    labels = objects["VMPodScrape"]["metadata"]["labels"]
    assert agent["podScrapeSelector"]["matchLabels"].items() <= labels.items()
    labels = objects["VMRule"]["metadata"]["labels"]
    assert alert["ruleSelector"]["matchLabels"].items() <= labels.items()
    single = objects["VMSingle"]["metadata"]["name"]
    store = f"http://vmsingle-{single}.syncscope.svc:8429"  # the operator's Service for it
    assert agent["remoteWrite"] == [{"url": store + "/api/v1/write"}]
    assert alert["datasource"]["url"] == alert["remoteWrite"]["url"] == store
    # The rules are vmalert's variant, the same groups as the compose project's file.
    vmalert_rules = yaml.safe_load((VM / "rules" / "syncscope.rules.yml").read_text())
    assert objects["VMRule"]["spec"] == vmalert_rules
    # The scrapes are the Prometheus operator's, endpoint for endpoint.
    assert (
        objects["VMServiceScrape"]["spec"]["selector"]
        == by_kind("ServiceMonitor", "daemonset")["spec"]["selector"]
    )
    assert (
        objects["VMPodScrape"]["spec"]["selector"]
        == by_kind("PodMonitor", "sidecar")["spec"]["selector"]
    )
    assert (
        objects["VMServiceScrape"]["spec"]["endpoints"]
        == (by_kind("ServiceMonitor", "daemonset")["spec"]["endpoints"])
    )
    for doc in objects.values():
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["namespace"] == "syncscope"


# -------------------------------------------------------------------- script and docs


def test_install_script_is_valid_bash_with_pinned_packages():
    script = ROOT / "scripts" / "install-observability-tools"
    assert script.stat().st_mode & 0o111, "must be executable"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    for pin in ("check-jsonschema==0.39.0", "kubernetes-validate==1.37.0"):
        assert f'"{pin}"' in text
    assert "APT_PACKAGES=(prometheus prometheus-alertmanager)" in text


def test_observability_doc_covers_what_was_and_was_not_run():
    doc = (ROOT / "docs" / "observability.md").read_text()
    for heading in ("## What was run", "## What was not run", "## For the end-to-end test"):
        assert heading in doc


def test_vmalert_rules_read_back_only_the_per_rank_rates_of_their_own_group():
    """vmalert reads a record back from VictoriaMetrics an evaluation late: within a group, a
    rule may name a record of that group only where that record takes a range of scraped
    series (the per-rank rates) or has a series per rank (the leads): too costly to recompute
    in every rule that reads it; the others are inlined. Such a rule is evaluated before the
    record, so that it reads the previous evaluation's samples whole, never some of this
    one's. The Prometheus file keeps every reference, each after the record it reads. Over a
    range (`x[10m]`) or with a selector a rule reads the stored series on both engines, and
    another group's record too."""
    from syncscope.monitoring import engines

    cfg = load_config()
    found_inlined = False
    read_back: set[str] = set()
    for engine in ("prometheus", "vmalert"):
        groups = engines.rule_groups(cfg, engine)["groups"]
        recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
        for group in groups:
            exprs = {r["record"]: r["expr"] for r in group["rules"] if "record" in r}
            for i, rule in enumerate(group["rules"]):
                named = [
                    n
                    for n in exprs
                    if n != rule.get("record")
                    and re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:{{\[])", rule["expr"])
                ]
                later = {r["record"] for r in group["rules"][i + 1 :] if "record" in r}
                if engine == "vmalert":
                    costly = [
                        n for n in named if "rate(syncscope_" in exprs[n] or engines.per_rank(n)
                    ]
                    assert named == costly, (group["name"], rule.get("record"), named)
                    assert set(named) <= later, (group["name"], rule.get("record"), named)
                    read_back |= set(named)
                else:
                    found_inlined |= bool(set(named) - later)
                if "record" in rule:
                    assert engines.ranges_scraped_series(rule["expr"], recorded) == bool(
                        re.search(r"_over_time\(syncscope_|rate\(syncscope_", rule["expr"])
                    ), rule["expr"]
    # The straggler's per-rank exposed communication is read back, not recomputed six times.
    assert "job_rank:syncscope_phase_blocked_seconds_per_step:ratio" in read_back
    assert "job_rank:syncscope_phase_blocked_seconds_per_step:minus_job_min" in read_back
    assert found_inlined  # the Prometheus rules do chain within groups: the check means something
