# Shared by scripts/one_gpu_runs.sh, multi_gpu_runs.sh and four_gpu_runs.sh (sourced; $out set by the caller).

# The commit every result file records (occult/tools/run_record.py, docs/settings.md): HEAD, "-dirty" when
# tracked files differ, where git works at the checkout's top; else the processes read a COMMIT file at the
# root (`git rev-parse HEAD > COMMIT` before copying the tree to a machine without .git) or record null.
export_commit() {
  local root top commit
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
  top=$(git -C "$root" rev-parse --show-toplevel 2>/dev/null) || return 0
  [ "$(cd "$top" && pwd -P)" = "$root" ] || return 0
  commit=$(git -C "$root" rev-parse HEAD 2>/dev/null) || return 0
  [ -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit-dirty"
  export OCCULT_COMMIT=$commit
}
[ -n "${OCCULT_COMMIT:-}" ] || export_commit

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
