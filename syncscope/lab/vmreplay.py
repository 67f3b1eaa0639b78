"""Replay syncscope's rules over stored data with ``vmalert -replay``, in dependency stages.

vmalert replays one rule at a time over the whole range, and a rule that reads another rule's
records sees them only once VictoriaMetrics has made them searchable (up to a second or two
later). Its own remedy, ``-replay.rulesDelay``, waits after every rule: a minute for syncscope's
rules. Here the rules are split into stages (a rule's stage is one more than the highest stage
of the records it reads), each stage is replayed without delay, and VictoriaMetrics is flushed
between stages, so every rule reads its inputs complete at every evaluation, as promtool's
ordered evaluation does.

    vm = VictoriaMetrics(workdir); vm.wait_ready(); vm.import_prometheus(text)
    replay_in_stages(engines.rule_groups(cfg, "vmalert"), vm, start, end, workdir)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from syncscope.lab.servers import VictoriaMetrics, vmalert_replay
from syncscope.monitoring.rules import dump_yaml, metric_names


def stages(groups: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rule file ``groups`` split into rule files whose rules read only earlier stages'
    records, alerting rules with the records they read, without their annotations. Group
    names and intervals are kept."""
    # Annotations are dropped: vmalert refuses the `query` template in replay mode, and the
    # ALERTS series replayed here do not depend on them.
    rules = [
        (g, {k: v for k, v in r.items() if k != "annotations"})
        for g in groups["groups"]
        for r in g["rules"]
    ]
    recorded = {r["record"] for _g, r in rules if "record" in r}
    stage_of: dict[str, int] = {}

    def stage(rule: Mapping[str, Any]) -> int:
        own = rule.get("record")
        inputs = (metric_names(rule["expr"]) & recorded) - {own}
        return 1 + max((resolve(name) for name in inputs), default=-1)

    def resolve(name: str) -> int:
        if name not in stage_of:
            stage_of[name] = 0  # a cycle would read its own stage: vmalert rejects none here
            stage_of[name] = max(stage(r) for _g, r in rules if r.get("record") == name)
        return stage_of[name]

    by_stage: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for group, rule in rules:
        by_stage.setdefault(stage(rule), []).append((group, rule))
    files = []
    for _n, members in sorted(by_stage.items()):
        out_groups: dict[str, dict[str, Any]] = {}
        for group, rule in members:
            head = {k: v for k, v in group.items() if k != "rules"}
            out_groups.setdefault(group["name"], {**head, "rules": []})["rules"].append(rule)
        files.append({"groups": list(out_groups.values())})
    return files


def replay_in_stages(
    groups: Mapping[str, Any],
    vm: VictoriaMetrics,
    time_from: float,
    time_to: float,
    workdir: str,
) -> int:
    """Replay ``groups`` (a vmalert rule file's contents) over [time_from, time_to] into ``vm``;
    returns the number of stages."""
    files = stages(groups)
    for n, doc in enumerate(files):
        path = os.path.join(workdir, f"stage-{n}.rules.yml")
        with open(path, "w") as f:
            f.write(dump_yaml(doc))
        vmalert_replay(path, vm.url, time_from, time_to, rules_delay="0s")
        vm.force_flush()
    return len(files)
