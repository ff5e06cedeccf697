#!/usr/bin/env bash
# Profile ddlkernels' allreduce with py-spy on every rank, then summarize where the time goes.
#   mpirun -n 2 bash bench/studies/profile_engine.sh 16M [profile_engine.py options]
# Writes $PROFILE_DIR/prof-<size>.<rank>.txt (raw collapsed stacks; default /tmp) and, from rank 0
# after every rank is done, the summary of bench/studies/pyspy_summary.py.  PYSPY_ARGS adds py-spy options
# (e.g. --native to see inside MPI and numpy).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY=${PYTHON:-$(command -v python)}
SPY=${PYSPY:-$(dirname "$PY")/py-spy}
SIZE=${1:-16M}; shift || true
OUT=${PROFILE_DIR:-/tmp}
RANK=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
"$SPY" record -r ${PYSPY_RATE:-400} --format raw ${PYSPY_ARGS:-} -o "$OUT/prof-$SIZE.$RANK.txt" -- \
  "$PY" "$HERE/profile_engine.py" "$SIZE" "$@" > "$OUT/prof-$SIZE.$RANK.log" 2>&1 || {
  cat "$OUT/prof-$SIZE.$RANK.log" >&2; exit 1; }
grep -h "^#" "$OUT/prof-$SIZE.$RANK.log" || true
