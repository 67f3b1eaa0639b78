#!/usr/bin/env bash
# Issue 32 on the device machine's cores (16, 128 GiB): bench/bench_scale.py through the
# VictoriaMetrics path (vmagent shards, VictoriaMetrics, vmalert, the shipped rules) at a size
# 2 shared vCPUs cannot feed (docs/scale.md, "The largest size reached"), its figures in one
# file ($OUT/scale-figures.txt), the whole log and the bench's JSON beside it.
#
# On the device (one call; the wheels and the VictoriaMetrics binaries travel from here, made
# by scripts/device-wheels), after the GPU checks have had their turn:
#   run(command="NODES=4096 bash bench/scale_check.sh", carry=[".whl"], timeout_s=600)
# Here it runs the same at NODES=64 in under 3 minutes (SETTLE=60 DURATION=30).
#
#   NODES     emulated nodes of 8 ranks (default 4096: 32,768 ranks)
#   WORKERS   emulator processes (default: half the CPUs; one Python process feeds and renders
#             about 1,024 nodes a core)
#   SHARDS    vmagent shards (default 2)
#   SETTLE    seconds from the first scrape to the measurement (default 330: the 5 min
#             straggler window full, so "named once its window is full" is measured)
#   DURATION  seconds measured (default 90: six evaluations of 15 s)
# Nothing is pinned (--no-pin): the engines and the emulator share every CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
FIGURES=scale-figures.txt
. bench/device_common.sh
NODES=${NODES:-4096}
WORKERS=${WORKERS:-$(($(nproc) / 2 > 1 ? $(nproc) / 2 : 1))}
SHARDS=${SHARDS:-2}
SETTLE=${SETTLE:-330}
DURATION=${DURATION:-90}

section machine
say "nproc $(nproc); $(free -g | awk '/Mem:/ {print $2 " GiB memory, " $7 " available"}')"
if [ -d .whl/bin ]; then
  export PATH="$PWD/.whl/bin:$PATH"
  if ! ldconfig -p 2>/dev/null | grep -q 'libzstd\.so\.1 '; then  # the binaries link it
    export LD_LIBRARY_PATH="$PWD/.whl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
for b in victoria-metrics vmagent vmalert; do
  say "$b: $(command -v $b || echo 'not found (scripts/device-wheels copies it into .whl/bin)')"
done
cat .whl/bin/VERSIONS 2>/dev/null | tee -a "$FIG"  # Debian's build prints no -version

section install
install_syncscope

section scale
# bench_scale prints its tables as it goes; the summary is the log's last part
TAIL=70 run scale $((SETTLE + DURATION + 180)) "$PY" bench/bench_scale.py --sizes "$NODES" \
  --engine vm --workers "$WORKERS" --shards "$SHARDS" --no-pin --settle "$SETTLE" \
  --duration "$DURATION" --json "$OUT/scale.json"

say ""
say "figures: $FIG; logs: $OUT"
