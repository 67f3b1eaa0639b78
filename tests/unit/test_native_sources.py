"""The agent's C++ sources compile as C++17 too: torch up to 2.12 builds extensions with
-std=c++17 (torch.utils.cpp_extension's default until 2.13 made it C++20), as a GPU machine's
image with an older torch does, and a source that leans on C++20 headers bringing in a standard
header (hot_path.cpp's placement new once did, <new>) builds here and not there.

A syntax check (`g++ -fsyntax-only`) against this Python's and the installed torch's headers:
torch 2.13's own headers use C++20 constructs GCC takes in C++17 mode with warnings, which are
not the question here."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch.utils import cpp_extension  # noqa: E402

CSRC = Path(__file__).resolve().parents[2] / "agent" / "csrc"
# hot_path.cpp includes Python's headers only (a fraction of a second); the others torch's
# (several seconds each): those are left to `make test`.
SOURCES = [
    pytest.param(name, id=name, marks=() if name == "hot_path.cpp" else pytest.mark.slow)
    for name in sorted(p.name for p in CSRC.glob("*.cpp"))
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ (scripts/setup installs it)")
@pytest.mark.parametrize("name", SOURCES)
def test_source_compiles_as_cpp17(name: str) -> None:
    includes = [sysconfig.get_paths()["include"], *cpp_extension.include_paths()]
    command = ["g++", "-std=c++17", "-fsyntax-only", "-w", *(f"-I{d}" for d in includes)]
    done = subprocess.run([*command, str(CSRC / name)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
