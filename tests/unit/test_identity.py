"""Who reports: the job and node labels from the launcher and the orchestrator, so that a job
keeps one identity across its restarts and a node joins with the node's other exporters."""

from __future__ import annotations

import socket

from syncscope.agent.config import AgentConfig, launcher_job_id, node_name, process_identity


def test_the_job_is_the_setting_else_the_launchers_id():
    assert AgentConfig.resolve({}, env={}).job == "default"
    elastic = {"TORCHELASTIC_RUN_ID": "run-7", "SLURM_JOB_ID": "4242"}
    assert AgentConfig.resolve({}, env=elastic).job == "run-7"
    # torchrun without --rdzv-id says "none": not an id; Slurm's job id is.
    assert AgentConfig.resolve({}, env={**elastic, "TORCHELASTIC_RUN_ID": "none"}).job == "4242"
    assert AgentConfig.resolve({}, env={**elastic, "SYNCSCOPE_JOB": "mine"}).job == "mine"
    assert AgentConfig.resolve({"job": "kw"}, env=elastic).job == "kw"
    assert launcher_job_id({"TORCHELASTIC_RUN_ID": "none"}) is None


def test_the_node_is_the_setting_else_kubernetes_else_slurm_else_the_hostname():
    assert node_name({}) == socket.gethostname()
    env = {"SLURMD_NODENAME": "gpu017"}
    assert node_name(env) == "gpu017"
    env["NODE_NAME"] = "ip-10-0-3-17.ec2.internal"  # the pod's spec.nodeName
    assert node_name(env) == "ip-10-0-3-17.ec2.internal"
    env["SYNCSCOPE_NODE"] = "rack3-n17"
    assert node_name(env) == "rack3-n17"
    assert process_identity(env)["hostname"] == "rack3-n17"
    assert len(node_name({"NODE_NAME": "x" * 500})) < 500  # bounded like every label
