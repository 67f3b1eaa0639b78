"""`pip install .` and `pip install -e .` both give syncscope.agent/exporter/sim, and nothing top-level."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
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
