# Sourced by the device machine's check scripts (bench/gpu_check.sh, bench/scale_check.sh) from
# the repository root: where the figures go, how each step is run and logged, and the install
# from what travelled with the working tree. The sourcing script sets FIGURES (its file's name).
OUT=${OUT:-$(mktemp -d /tmp/device-check.XXXXXX)}
mkdir -p "$OUT"
FIG="$OUT/$FIGURES"
PY=${PYTHON:-python3}
: >"$FIG"
say() { echo "$*" | tee -a "$FIG"; }
section() { say ""; say "== $1 ($(date -u +%H:%M:%S))"; }

# BUDGET_S: the seconds the whole script may take (the device call's timeout_s less the
# machine's start): each step's own timeout is cut to what is left of it less 15 s, so that a
# bench is stopped (SIGTERM: bench_fsdp2_overhead then reports the rounds it finished) and the
# figures are written before the call itself is killed. Unset: each step's own timeout.
BUDGET_S=${BUDGET_S:-}

# run NAME SECONDS CMD...: the command's log to $OUT/NAME.log, its last lines and status to FIG
run() {
  local name=$1 seconds=$2
  shift 2
  if [ -n "$BUDGET_S" ]; then
    local left=$((BUDGET_S - SECONDS - 15))
    if [ "$left" -lt 10 ]; then
      say "-- $name: SKIPPED (${BUDGET_S}s budget spent)"
      return 124
    fi
    if [ "$left" -lt "$seconds" ]; then seconds=$left; fi
  fi
  timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-15}" "$OUT/$name.log" | tee -a "$FIG"
  case $rc in
    0) say "-- $name: ok" ;;
    124) say "-- $name: TIMEOUT after ${seconds}s" ;;
    *) say "-- $name: exit $rc" ;;
  esac
  return $rc
}

# The exporter's web stack from .whl/ (scripts/device-wheels), syncscope itself without deps.
install_syncscope() {
  if [ -d .whl ]; then
    TAIL=3 run wheels 120 "$PY" -m pip install -q --no-index --find-links .whl \
      fastapi uvicorn pydantic
  else
    say "no .whl/ (scripts/device-wheels makes it): using what $PY has"
  fi
  TAIL=3 run syncscope 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || TAIL=3 run syncscope-copy 120 "$PY" -m pip install -q --no-deps --no-build-isolation .
}
