"""detail="buckets" (issue 16): the comm hook attach() registers must pass DDP's own check, and
then time every gradient bucket through the patched all_reduce, in a real gloo world of one."""

from __future__ import annotations

import inspect
import logging

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from syncscope.agent import Agent, attach  # noqa: E402
from syncscope.agent.collectives import bucket_timing_hook  # noqa: E402

STEPS = 4
FALLBACK = "per-bucket timing unavailable"


def two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    # 256x256 fp32 weights are 0.25 MiB each: with bucket_cap_mb=0.25, DDP's rebuilt buckets
    # (from the second step on) hold one layer each, so there is more than one bucket to time.
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))


def test_the_hook_carries_the_annotations_ddp_checks_as_real_objects():
    sig = inspect.signature(bucket_timing_hook(world_size=1, record=lambda size, ns: None))
    assert list(sig.parameters)[1] == "bucket"
    assert sig.parameters["bucket"].annotation is dist.GradBucket
    assert sig.return_annotation == torch.futures.Future[torch.Tensor]


def test_ddp_accepts_the_bucket_hook_and_every_bucket_is_timed(
    gloo_world_of_one, monkeypatch, caplog
):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    model = torch.nn.parallel.DistributedDataParallel(two_layers(), bucket_cap_mb=0.25)
    reference = two_layers()  # same weights, no DDP and no hook: what the gradients must be
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    caplog.set_level(logging.WARNING, logger="syncscope.agent")
    # A flush would drain the queue this test reads: none happens while it runs.
    agent = attach(
        model=model, optimizer=opt, exporter=None, detail="buckets", flush_interval_s=3600
    )
    try:
        assert isinstance(agent, Agent)
        assert not [r for r in caplog.records if FALLBACK in r.getMessage()]
        # DDP itself holds the hook: register_comm_hook ran to the end.
        assert [h.__name__ for h, _state in model._comm_hooks] == ["syncscope_bucket_hook"]
        assert model._comm_hooks[0][1] is model.process_group

        for _ in range(STEPS):
            x = torch.randn(8, 256)
            model(x).pow(2).mean().backward()
            reference(x).pow(2).mean().backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()

        buckets: dict[int, list[int]] = {}
        for op, group, nbytes, duration_ns, step in list(agent.queues.collectives):
            if op == "all_reduce":
                assert group == "default_pg" and duration_ns > 0
                buckets.setdefault(step, []).append(nbytes)
        assert sorted(buckets) == list(range(STEPS))  # the hook ran on every step
        for step, sizes in buckets.items():
            assert sum(sizes) == grad_bytes, (step, sizes)  # every gradient byte, once
        assert all(len(buckets[s]) >= 2 for s in range(1, STEPS)), buckets  # per bucket
        assert agent.stats["errors"] == 0
        # The hook's all-reduce (divided by a world of one) left the gradients as they were.
        for p, q in zip(model.module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q)
    finally:
        agent.close()
