"""`pip install .` and `pip install -e .` both give syncscope.agent/exporter/sim, and nothing top-level."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.background]
ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import importlib.util, json, sys
found = {name: importlib.util.find_spec(name) is not None for name in ("agent", "exporter", "sim")}
import syncscope.agent, syncscope.wire, syncscope.arrival
print(json.dumps({"top_level": found, "agent_file": syncscope.agent.__file__, "attach": hasattr(syncscope.agent, "attach")}))
"""


@pytest.mark.parametrize("editable", [False, True], ids=["plain", "editable"])
def test_install_layout(tmp_path, editable):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    target = ["-e", str(ROOT)] if editable else [str(ROOT)]
    # --no-deps: the agent side is stdlib-only, which is exactly what this proves.
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", *target],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    out = subprocess.run(
        [py, "-c", PROBE],
        check=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    ).stdout
    import json

    info = json.loads(out.strip().splitlines()[-1])
    assert info["top_level"] == {"agent": False, "exporter": False, "sim": False}
    assert info["attach"]
    if editable:
        assert Path(info["agent_file"]).resolve() == ROOT / "agent" / "__init__.py"
    else:
        assert "site-packages" in info["agent_file"]
        site = Path(info["agent_file"]).parents[2]
        assert not (site / "agent").exists() and not (site / "exporter").exists()
        assert (site / "syncscope" / "exporter" / "app.py").exists()
    assert sys.version_info >= (3, 10)


def test_wheel_outside_any_checkout_prints_rules_and_writes_dashboards(tmp_path):
    """The rules and dashboards ship with the package: no file of the checkout is read."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, ROOT],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = wheels.glob("syncscope-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    # With its declared dependencies, and nothing else: a missing one fails here.
    subprocess.run(
        [bin_dir / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel],
        check=True,
        cwd=tmp_path,
        timeout=600,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def syncscope(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [bin_dir / "syncscope", *args],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    printed = syncscope("rules")
    assert printed.returncode == 0, printed.stderr
    checked_in = ROOT / "deploy" / "prometheus" / "rules" / "syncscope.rules.yml"
    assert printed.stdout == checked_in.read_text()
    promtool = shutil.which("promtool")
    if promtool is not None:  # installed by scripts/setup test; the equality above stands alone
        rules_file = elsewhere / "rules.yml"
        rules_file.write_text(printed.stdout)
        check = subprocess.run(
            [promtool, "check", "rules", rules_file], capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr
    written = syncscope("dashboards", "--out", "dash")
    assert written.returncode == 0, written.stderr
    for name in ("syncscope-job-overview.json", "syncscope-fabric-locality.json", "queries.json"):
        assert (elsewhere / "dash" / name).read_text() == (ROOT / "dashboards" / name).read_text()
    bad = syncscope("rules", "--set", "alerts.NoSuchAlert.for=1m")
    assert bad.returncode == 2 and "NoSuchAlert" in bad.stderr
