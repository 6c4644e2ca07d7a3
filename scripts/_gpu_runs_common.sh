# Shared by scripts/one_gpu_runs.sh and scripts/multi_gpu_runs.sh (sourced; $out set by the caller).

run() {  # run NAME SECONDS COMMAND...: log to OUT/NAME.log, show the last lines (TAIL, default 14)
  local name=$1 secs=$2
  shift 2
  echo "== $name: $*"
  [ "${DRY_RUN:-0}" = 1 ] && return 0
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  echo "   rc=$?"
  tail -n "${TAIL:-14}" "$out/$name.log"
}

train_corpus() {  # print the prepared corpus folder, or exit 2 saying how to make one
  # the Shakespeare corpus, tokenized on the CPU machine (the GPU machine has no network), carried
  local data=${OCCULT_TRAIN_DATA:-.gpudata}
  if [ "${DRY_RUN:-0}" != 1 ] && [ ! -f "$data/manifest.json" ]; then
    echo "$(basename "$0"): no prepared corpus in $data: run 'python -m occult data prepare --corpus shakespeare,gcide --out .gpudata --vocab-size 8000 \&\& rm -r .gpudata/texts'" \
         "where the network is, and carry .gpudata (or set OCCULT_TRAIN_DATA)" >&2
    exit 2
  fi
  echo "$data"
}
