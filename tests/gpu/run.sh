#!/usr/bin/env bash
# The GPU suite in one command (docs/testing.md):
#   1. the collective tests under torchrun, one pytest process per visible GPU, over NCCL;
#   2. the single-process GPU tests (kernels at real shapes, one-rank layers, graph-captured generate, a killed
#      rank under NCCL, a checkpoint resumed across GPU counts);
#   3. the single-process tests that spawn whole multi-rank decodes and check the ranks exit (STAGE3_TESTS);
#   then a summary table (versions, every case on every rank) on stdout and in OUT/summary.md.
# Usage: bash tests/gpu/run.sh [OUT]            (OUT defaults to gpu-suite-results/)
#        OCCULT_GPU_SUITE_NPROC=2 bash tests/gpu/run.sh   (fewer ranks than GPUs)
#        OCCULT_GPU_SUITE_BACKEND=gloo bash tests/gpu/run.sh  (gloo over CUDA tensors; ranks may share
#                                                          GPUs, so 1 GPU gives 2 ranks: not NCCL)
#        OCCULT_GPU_SUITE_MEMORY_GIB=78 bash tests/gpu/run.sh  (each pytest process's allocator capped at 78 GiB
#                                                          per GPU: what fits an 80 GB H100, on a larger card)
#        OCCULT_GPU_SUITE_ON_CPU=1 bash tests/gpu/run.sh  (the collective tests on 2 CPU gloo ranks:
#                                                          checks the suite's logic, not NCCL)
#        OCCULT_GPU_SUITE_STAGES=1a bash tests/gpu/run.sh  (stage 1's first half: STAGE1A_TESTS, the compile-heavy
#                                                          files; =1b the rest of stage 1: each half fits a call
#                                                          with room, where stage 1 whole nears the 10 minutes)
#        OCCULT_GPU_SUITE_DRY_RUN=1 ...                    (prints stage 1's pytest targets, runs nothing)
#        OCCULT_GPU_SUITE_STAGES=1 bash tests/gpu/run.sh   (stage 1 only; =2, =3, ='2 3': those stages. Each
#                                                          fits one 10-minute device call with margin (docs/
#                                                          testing.md has their times); on 4 GPUs two 2-rank
#                                                          runs can share a call: CUDA_VISIBLE_DEVICES=0,1 /
#                                                          2,3, OUT apart)
# A partial summary is written after stage 1, so a run stopped in stage 2 keeps stage 1's table; every case's
# outcome is also appended to OUT/progress-*.tsv as it finishes (a failure's traceback to OUT/failures-*.txt),
# so a stage cut by an outer time limit (`timeout`) still leaves what ran: `python tests/gpu/summary.py OUT` then reads those.
# Extra pytest arguments go in PYTEST_ARGS, parsed like a shell command line
# (e.g. PYTEST_ARGS="-k olmoe", PYTEST_ARGS="-k 'not olmoe_1b_7b'").
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-gpu-suite-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export OCCULT_GPU_SUITE_OUT=$out
# PYTEST_ARGS as words, quotes honoured (xargs parses shell-style quoting; no command substitution)
extra=()
if [ -n "${PYTEST_ARGS:-}" ]; then
  parsed=$(printf '%s' "$PYTEST_ARGS" | xargs -n1 printf '%s\n') || { echo "PYTEST_ARGS does not parse: $PYTEST_ARGS" >&2; exit 2; }
  mapfile -t extra <<< "$parsed"
fi
rm -f "$out"/rank*.xml "$out"/rank*.log "$out"/rank*.rc "$out"/single*.xml "$out"/versions.txt "$out"/summary.md \
  "$out"/progress-*.tsv "$out"/failures-*.txt
stages=" ${OCCULT_GPU_SUITE_STAGES:-1 2 3} "
firsts=0
for s in $stages; do
  case $s in 1|1a|1b) firsts=$((firsts + 1)) ;; 2|3) ;; *) echo "OCCULT_GPU_SUITE_STAGES='${OCCULT_GPU_SUITE_STAGES}': give stages among 1 (or its halves 1a, 1b), 2, 3 (e.g. '2 3')" >&2; exit 2 ;; esac
done
if [ $firsts -gt 1 ]; then
  echo "OCCULT_GPU_SUITE_STAGES='${OCCULT_GPU_SUITE_STAGES}': give one of 1, 1a, 1b (1 is both halves; they write the same rank files)" >&2
  exit 2
fi
# stage 1's first half (1a): the files whose cases compile the most (traced layers, transformers models, captured
# steps), about half of stage 1's time; 1b is every other collective file, so a new one is never left out
STAGE1A_TESTS=(tests/gpu/test_collective_traced_moe.py tests/gpu/test_collective_hf.py
  tests/gpu/test_collective_captured_step.py)
# stage 3's files (the rest of the single-process tests are stage 2's, so a new one is never left out)
STAGE3_TESTS=(tests/gpu/test_exit_after_graph_decode.py)
python=${PYTHON:-python3}
if [ "${OCCULT_GPU_SUITE_ON_CPU:-0}" = 1 ]; then
  nproc=${OCCULT_GPU_SUITE_NPROC:-2}
else
  ngpu=$($python -c 'import torch; print(torch.cuda.device_count())')
  if [ "${OCCULT_GPU_SUITE_BACKEND:-nccl}" = gloo ]; then
    nproc=${OCCULT_GPU_SUITE_NPROC:-$(( ngpu < 2 ? 2 : ngpu ))}
  else
    nproc=${OCCULT_GPU_SUITE_NPROC:-$ngpu}
  fi
  if [ "$ngpu" -lt 1 ]; then
    echo "the GPU suite needs a GPU (found none); OCCULT_GPU_SUITE_ON_CPU=1 checks its logic on CPU" >&2
    exit 2
  fi
  # stage 2 alone runs on one GPU (its multi-GPU cases skip, saying so); stages 1 and 3 need ranks
  if [ "$stages" != " 2 " ] && { [ "$nproc" -lt 2 ] || { [ "${OCCULT_GPU_SUITE_BACKEND:-nccl}" = nccl ] && [ "$nproc" -gt "$ngpu" ]; }; }; then
    echo "the GPU suite's stages 1 and 3 over NCCL need at least 2 GPUs and one per rank (found $ngpu GPUs," \
         "$nproc ranks); OCCULT_GPU_SUITE_STAGES=2 runs on one GPU; OCCULT_GPU_SUITE_BACKEND=gloo shares GPUs between ranks; OCCULT_GPU_SUITE_ON_CPU=1 checks its logic on CPU" >&2
    exit 2
  fi
fi
first=""
case $stages in *" 1 "*) first=1; targets=(tests/gpu) ;; *" 1a "*) first=1a; targets=("${STAGE1A_TESTS[@]}") ;;
  *" 1b "*) first=1b; targets=(tests/gpu); for f in "${STAGE1A_TESTS[@]}"; do targets+=(--ignore="$f"); done ;; esac
if [ "${OCCULT_GPU_SUITE_DRY_RUN:-0}" = 1 ]; then  # what stage 1 would collect, and nothing run
  [ -z "$first" ] || echo "stage $first: ${targets[*]}"
  exit 0
fi
# Megatron-Core's GPU cases (test_collective_megatron.py) need it importable: the GPU image has no network, so a
# carried wheel (`bash scripts/fetch_peer_wheels.sh megatron`, then carry .whl; OCCULT_GPU_SUITE_WHEELS names another
# directory) is installed into a directory of its own for this run, only it (not the other peers' wheels, which
# would replace the image's transformers).
if ! $python -c 'import megatron.core' 2>/dev/null; then
  wheel=$(ls "${OCCULT_GPU_SUITE_WHEELS:-.whl}"/megatron_core-*.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    site=$(mktemp -d /tmp/occult-gpu-suite-site.XXXXXX)  # (not under OUT, which is handed back)
    if $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel"; then
      export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site"
      echo "megatron-core from $wheel (for test_collective_megatron.py)"
    else
      echo "could not install $wheel: test_collective_megatron.py will skip" >&2
    fi
  fi
fi
rc1=0
if [ -n "$first" ]; then
  echo "== stage $first: collective tests on $nproc ranks (torchrun)"
  $python -m torch.distributed.run --standalone --nproc-per-node "$nproc" tests/gpu/rank_pytest.py \
    "${targets[@]}" -q -p no:cacheprovider "${extra[@]}"
  rc1=$?
  for r in $(seq 0 $((nproc - 1))); do
    code=$(cat "$out/rank$r.rc" 2>/dev/null || echo missing)
    [ "$code" = 0 ] || { echo "rank $r: pytest exit code $code (log: $out/rank$r.log)"; rc1=1; }
  done
fi
$python tests/gpu/summary.py "$out" > /dev/null  # stage 1's table now: kept if stage 2 is cut short
rc2=0
if [ "${OCCULT_GPU_SUITE_ON_CPU:-0}" != 1 ] && [[ $stages == *" 2 "* ]]; then
  echo "== stage 2: single-process GPU tests"
  ignore=()
  for f in "${STAGE3_TESTS[@]}"; do ignore+=(--ignore="$f"); done
  OCCULT_GPU_SUITE_STAGE=2 $python -m pytest tests/gpu -q -p no:cacheprovider --junitxml="$out/single.xml" \
    "${ignore[@]}" "${extra[@]}"
  rc2=$?
  $python tests/gpu/summary.py "$out" > /dev/null  # stage 2's table now: kept if stage 3 is cut short
fi
if [ "${OCCULT_GPU_SUITE_ON_CPU:-0}" != 1 ] && [[ $stages == *" 3 "* ]]; then
  echo "== stage 3: single-process GPU tests that run whole multi-rank jobs to their exit"
  OCCULT_GPU_SUITE_STAGE=3 $python -m pytest "${STAGE3_TESTS[@]}" -q -p no:cacheprovider \
    --junitxml="$out/single3.xml" "${extra[@]}"
  rc=$?
  [ $rc = 0 ] || rc2=$rc
fi
echo "== summary"
$python tests/gpu/summary.py "$out"
[ $rc1 = 0 ] && [ $rc2 = 0 ]
