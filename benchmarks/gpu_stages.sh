# Sourced by benchmarks/run_jax_gpu.sh and benchmarks/run_torch_gpu.sh: one summary file per suite
# and stages that each run under a time limit of their own, so that a slow or failing stage costs
# only its share of a device call. The caller sets $framework (jax or torch); results go to
# $OUT/$framework (default benchmarks/results/$framework), run by $PYTHON (default python).
out=${OUT:-benchmarks/results}/$framework
mkdir -p "$out"
py=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
summary="$out/summary_$framework.md"

# summary_header TITLE CODE: starts $summary with TITLE, the date and commit, the card and what
# the Python CODE prints (library versions).
summary_header() {
  {
    echo "# $1 ($(date -u +%F), git $(git rev-parse --short HEAD 2>/dev/null))"
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $py -c "$2"
    echo '```'
  } > "$summary" 2>&1
  cat "$summary"
}

# stage LIMIT TITLE CMD...: runs CMD under LIMIT seconds; its output goes to the terminal and,
# fenced under TITLE, to the summary (the last 60 lines).
stage() {
  local limit=$1 title=$2; shift 2
  echo "== $title (limit ${limit}s)"
  SECONDS=0
  timeout "$limit" "$@" > "$out/stage.log" 2>&1
  local rc=$?
  cat "$out/stage.log"
  { printf '\n## %s (rc %s after %ss, limit %ss)\n\n```\n' "$title" "$rc" "$SECONDS" "$limit"
    tail -60 "$out/stage.log"; echo '```'; } >> "$summary"
  echo "== rc $rc after ${SECONDS}s"
}

# append FILE...: markdown files written by a stage, into the summary.
append() { for f in "$@"; do [ -f "$f" ] && { printf '\n### %s\n\n' "$(basename "$f")"; cat "$f"; } >> "$summary"; done; }
