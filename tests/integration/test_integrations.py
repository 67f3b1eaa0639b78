"""The framework adapters, each driving a real tiny training loop into a real exporter.

Every multi-rank run here is real gloo DDP, one process per rank with the FileStore rendezvous
of `syncscope.lab.launch` (so nothing listens beyond 127.0.0.1). Lightning and transformers are
optional: their tests skip where the package is absent and run where it is installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from syncscope.lab.launch import launch, wait_all
from tests.conftest import wait_until

# What each adapter measures (phases that add up, sync calls, counts) holds at any speed: these
# run beside the quiet tests, at idle priority.
pytestmark = pytest.mark.background

# A training script that knows nothing about syncscope: plain DDP.
PLAIN_DDP = """
import os, sys
import torch, torch.distributed as dist
from torch import nn

steps = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + os.environ["SYNCSCOPE_INIT_FILE"],
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randn(32, 1)
for _ in range(steps):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
print("trained", steps, "steps")
dist.barrier()
dist.destroy_process_group()
"""

# The same, building a new optimizer partway (a reset): `first` steps, then `then` more, each
# 30 ms at least (the ranks' counts must agree: each backward is an all-reduce).
REBUILT_OPTIMIZER = PLAIN_DDP.replace(
    """for _ in range(steps):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
print("trained", steps, "steps")""",
    """def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(0.03)
    return steps

steps = train(int(sys.argv[1]))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
print("trained", steps, "steps and", train(int(sys.argv[2])), "more")""",
).replace("import os, sys", "import os, sys, time")

LIGHTNING = """
import os
import torch, torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from syncscope.integrations.lightning import SyncscopeCallback

world = int(os.environ["WORLD_SIZE"])
# Our own FileStore rendezvous; Lightning uses an initialised process group as it is.
dist.init_process_group("gloo", init_method="file://" + os.environ["SYNCSCOPE_INIT_FILE"],
                        rank=int(os.environ["RANK"]), world_size=world)

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    def training_step(self, batch, _idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1)), batch_size=16)
trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy="ddp",
                     max_steps=int(os.environ["TEST_STEPS"]), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[SyncscopeCallback()])
trainer.fit(Tiny(), data)
"""

HUGGINGFACE = """
import os
import torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from syncscope.integrations.huggingface import SyncscopeCallback

dist.init_process_group("gloo", init_method="file://" + os.environ["SYNCSCOPE_INIT_FILE"],
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

# A config-only model: nothing is downloaded.
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
args = TrainingArguments(output_dir=os.environ["TEST_OUT"], max_steps=int(os.environ["TEST_STEPS"]),
                         per_device_train_batch_size=8, report_to=[], save_strategy="no",
                         logging_strategy="no", use_cpu=True, disable_tqdm=True,
                         dataloader_num_workers=0)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.add_callback(SyncscopeCallback(trainer))
trainer.train()
"""


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _run_ranks(
    world: int, tmp: Path, script: str, args: list[str], env: dict[str, str], runner: bool = False
) -> list[str]:
    """Run `script` on `world` real gloo ranks; return each rank's output."""
    (tmp / "train_script.py").write_text(script)
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp), str(Path(__file__).resolve().parents[2]), full_env.get("PYTHONPATH", "")]
    )
    if "SYNCSCOPE_DISABLE" not in env:
        full_env.pop("SYNCSCOPE_DISABLE", None)
    if runner:
        procs = launch(
            world,
            [str(tmp / "train_script.py"), *args],
            env=full_env,
            module="syncscope.integrations.run",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    else:
        procs = launch(
            world,
            args,
            env=full_env,
            module="train_script",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    codes = wait_all(procs, timeout=240)
    outputs = [p.stdout.read().decode(errors="replace") if p.stdout else "" for p in procs]
    assert codes == [0] * world, "ranks failed:\n" + "\n".join(o[-3000:] for o in outputs)
    return outputs


def _job(exporter: Any, name: str, world: int, min_steps: int) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        job = exporter.state()["jobs"].get(name)
        if (
            job
            and len(job["ranks"]) == world
            and all(r["steps_total"] >= min_steps for r in job["ranks"])
        ):
            return job
        return None

    job = wait_until(ready, timeout=10)
    assert job, f"job {name!r} did not report {min_steps} steps from {world} ranks: " + str(
        exporter.state()["jobs"].get(name)
    )
    return job


def _assert_measured(job: dict[str, Any], steps: int, optimizer: bool) -> None:
    for r in job["ranks"]:
        phases = r["phase_seconds_total"]
        assert phases["forward"] > 0 and phases["backward"] > 0, phases
        if optimizer:
            assert phases["optimizer"] > 0, phases
        # Phases add up to the step (the agent's invariant), through the adapter too.
        assert abs(sum(phases.values()) - r["step_seconds_sum"]) <= 0.05 * r["step_seconds_sum"]
        sync = [c for c in r["collectives"] if c["op"] == "ddp_grad_sync"]
        assert sync and sync[0]["calls"] >= steps - 2, (
            "the DDP wrapper was not found: no gradient-sync timing",
            r["collectives"],
        )
        assert r["arrival_lead_s"] is not None


def test_integrations_import_without_their_frameworks() -> None:
    code = (
        "import sys\n"
        "for m in ('lightning', 'lightning.pytorch', 'pytorch_lightning', 'transformers'):\n"
        "    sys.modules[m] = None\n"
        "import syncscope.integrations.lightning as L, syncscope.integrations.huggingface as H\n"
        "import syncscope.integrations.run\n"
        "for cls in (L.SyncscopeCallback, H.SyncscopeCallback):\n"
        "    try:\n"
        "        cls()\n"
        "    except ImportError as e:\n"
        "        print('hint:', e)\n"
        "    else:\n"
        "        raise SystemExit('constructed without its framework')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install lightning" in out.stdout and "pip install transformers" in out.stdout


def test_runner_usage() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "syncscope.integrations.run"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "usage" in out.stderr


@pytest.mark.slow
def test_runner_attaches_an_unmodified_script(exporter: Any, tmp_path: Path) -> None:
    steps = 40
    env = {"SYNCSCOPE_EXPORTER": exporter.url, "SYNCSCOPE_JOB": "runner"}
    outputs = _run_ranks(2, tmp_path, PLAIN_DDP, [str(steps)], env, runner=True)
    assert all(f"trained {steps} steps" in o for o in outputs), outputs
    job = _job(exporter, "runner", 2, steps - 1)
    # The first step is spent finding the model and optimizer; every later one is measured.
    assert [r["steps_total"] for r in job["ranks"]] == [steps - 1, steps - 1]
    _assert_measured(job, steps, optimizer=True)

    # SYNCSCOPE_DISABLE=1: the same command runs the script untouched and reports nothing.
    env = {**env, "SYNCSCOPE_JOB": "runner-off", "SYNCSCOPE_DISABLE": "1"}
    outputs = _run_ranks(1, tmp_path, PLAIN_DDP, ["5"], env, runner=True)
    assert "trained 5 steps" in outputs[0], outputs
    time.sleep(1.0)
    assert "runner-off" not in exporter.state()["jobs"]


@pytest.mark.slow
def test_the_runner_follows_an_optimizer_the_script_builds_partway(
    exporter: Any, tmp_path: Path
) -> None:
    """The script replaces its optimizer after 150 steps (5 s) and trains on for 500 (15 s):
    each rank's agent moves its step hooks to the new one and says so, and the new optimizer's
    steps after that are counted, phases adding up."""
    env = {"SYNCSCOPE_EXPORTER": exporter.url, "SYNCSCOPE_JOB": "rebuilt"}
    outputs = _run_ranks(2, tmp_path, REBUILT_OPTIMIZER, ["150", "500"], env, runner=True)
    assert all("trained 150 steps and 500 more" in o for o in outputs), outputs
    for o in outputs:
        assert "they now end at AdamW's" in o and "and no step" not in o, o[-3000:]
    job = _job(exporter, "rebuilt", 2, 150)
    # The runner's first step is spent finding the model. The reporter looks at least every
    # 4 s (its timer, with no step ending) and asks after 3 s with no step: the new optimizer
    # is followed within 10 s of the swap, 333 of its steps of 30 ms, never at its first step.
    counted = [r["steps_total"] - 149 for r in job["ranks"]]
    assert all(500 - 333 <= n <= 499 for n in counted), counted
    _assert_measured(job, 150, optimizer=True)


def _assert_work(job: dict[str, Any], samples: int, tokens: int | None) -> None:
    """Every rank's sample (and token) counter equals the job's own count exactly."""
    for r in job["ranks"]:
        assert (r["samples_total"], r["tokens_total"]) == (samples, tokens), (
            r["rank"],
            r["steps_total"],
            r["samples_total"],
            r["tokens_total"],
        )


@pytest.mark.slow
@pytest.mark.skipif(
    not (_installed("lightning") or _installed("pytorch_lightning")),
    reason="PyTorch Lightning not installed (optional extra: syncscope[lightning])",
)
def test_lightning_callback_on_a_real_ddp_run(exporter: Any, tmp_path: Path) -> None:
    steps = 40
    env = {
        "SYNCSCOPE_EXPORTER": exporter.url,
        "SYNCSCOPE_JOB": "lightning",
        "TEST_STEPS": str(steps),
        "MASTER_PORT": "1",  # never used (the process group exists); stops a port search
    }
    _run_ranks(2, tmp_path, LIGHTNING, [], env)
    job = _job(exporter, "lightning", 2, steps - 1)
    _assert_measured(job, steps, optimizer=False)
    # The job's own count: max_steps batches of 16 (x, y) pairs per rank; no token inputs.
    _assert_work(job, samples=16 * steps, tokens=None)


@pytest.mark.slow
@pytest.mark.skipif(
    not (_installed("transformers") and _installed("accelerate")),
    reason="transformers/accelerate not installed (optional extra: syncscope[huggingface])",
)
def test_huggingface_callback_on_a_real_ddp_run(exporter: Any, tmp_path: Path) -> None:
    steps = 30
    env = {
        "SYNCSCOPE_EXPORTER": exporter.url,
        "SYNCSCOPE_JOB": "huggingface",
        "TEST_STEPS": str(steps),
        "TEST_OUT": str(tmp_path / "out"),
        "MASTER_PORT": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    _run_ranks(2, tmp_path, HUGGINGFACE, [], env)
    job = _job(exporter, "huggingface", 2, steps - 1)
    _assert_measured(job, steps, optimizer=True)
    # The Trainer's own count: max_steps batches of 8 sequences of 16 token ids per rank.
    _assert_work(job, samples=8 * steps, tokens=8 * 16 * steps)
