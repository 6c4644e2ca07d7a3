#!/usr/bin/env bash
# Issue 38 on a pair of GPUs (the ones CUDA_VISIBLE_DEVICES names), one device call per part:
#
#   bash scripts/two_gpu_training.sh OUT [LINKS] [PART]   LINKS: "nvlink slow" (default), PART: train (default) | more | all
#   GPUS=4 bash scripts/two_gpu_training.sh OUT nvlink train   # the train part's multi-GPU runs on 4 GPUs (issue 52)
#   DRY_RUN=1 bash scripts/two_gpu_training.sh /tmp/x "nvlink slow" all   # print every command
#   TINY=1 bash scripts/two_gpu_training.sh /tmp/x "nvlink slow" all      # the same on 2 CPU gloo ranks, tiny sizes
#
# train  occult train tokens/s (OccultLM 4 layers, hidden 1024, 64 experts x 512 top-8, seq 1024, bf16; SIZE=olmoe:
#        hidden 2048, 64 experts x 1024, OLMoE-1B-7B's layer shape, where the GPU's work outweighs the host's):
#        1 GPU; 2 GPUs floor (--ep-size 1); EP standard / dedup with ddp and fsdp, dedup with --layer-graphs
#        (slow link: floor and the two dispatchers with ddp), dedup as two interleaved halves in a recorded step
#        (--two-batch --captured-step, both links), 4 accumulated micro-batches a step recorded, paired
#        (--micro-batches 4 --pair-micro-batches: combined 1F1B), in turn and for the floor (both links),
#        FSDP2 as one unit (--fsdp-units model) and with the step recorded (NVLink). Runs go in order of
#        importance; one that would start after BUDGET_S seconds is skipped and listed as such;
#        ONLY="slow_floor nvlink_dedup_fsdp ..." runs just
#        those (LINK_VARIANT names as in OUT/runs); ROUNDS=N runs them all N times, a round after another
#        (runs named ..._rK; the summary takes each variant's median run: short eager runs move by tens of percent
#        between jobs; `ratios_per_round` pairs each round's runs); a 20-step DDP run warms the machine first,
#        not counted (WARMUP=0: none).
#        -> OUT/train_{link}_{GPUS}xGPU.json (GPUS: 2 by default;
#        the batch is 8 sequences per GPU, the floor data-parallel over all of them)
# more   finetune --hf on 1 and 2 GPUs + logits through plain transformers -> OUT/finetune_hf_2xGPU.json;
#        tests/gpu/test_resume_across_gpu_counts.py; re-placement over NCCL -> OUT/replacement_2xGPU.json
#
# Carry .gpudata (python -m occult data prepare --corpus shakespeare,gcide --out .gpudata --vocab-size 8000
# && rm -r .gpudata/texts). "slow" = NCCL_P2P_DISABLE=1. NVLink multicast stays off in every process.
set -uo pipefail
out=${1:?usage: two_gpu_training.sh OUT [LINKS] [PART]}
links=${2:-nvlink slow}
part=${3:-train}
case $part in train|more|all) ;; *) echo "two_gpu_training.sh: unknown part '$part' (train, more, all)" >&2; exit 2 ;; esac
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/_gpu_runs_common.sh"  # run(), train_corpus()
export TAIL=${TAIL:-6}
here=$(dirname "$0")
gpus=${GPUS:-2}  # the train part's multi-GPU runs (the more part: 2)
case $gpus in 2|3|4|5|6|7|8) ;; *) echo "two_gpu_training.sh: GPUS=$gpus: give 2 to 8" >&2; exit 2 ;; esac
rounds=${ROUNDS:-1}  # the train part's runs this many times, a round after another (the summary: each variant's median)
case $rounds in 1|2|3|4|5|6|7|8|9) ;; *) echo "two_gpu_training.sh: ROUNDS=$rounds: give 1 to 9" >&2; exit 2 ;; esac
case ${SIZE:-small} in small|olmoe) ;; *) echo "two_gpu_training.sh: SIZE=$SIZE: give small or olmoe" >&2; exit 2 ;; esac
round=1
tr="python3 -m torch.distributed.run --standalone --nproc-per-node $gpus"  # --standalone: a free port per job
tr2="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
runs=${RUNS_DIR:-/tmp/occult_two_gpu.$$}  # per job: two jobs may share the host
budget=${BUDGET_S:-300}  # no train run starts later than this (seconds into the job)
if [ "${TINY:-0}" = 1 ]; then  # CPU gloo ranks, the same commands at toy sizes
  export OCCULT_TRAIN_DATA=${OCCULT_TRAIN_DATA:-$runs/tinydata}
  [ -f "$OCCULT_TRAIN_DATA/manifest.json" ] || [ "${DRY_RUN:-0}" = 1 ] || python3 -m occult data prepare --out "$OCCULT_TRAIN_DATA" \
    --corpus-dir tests/data/shakespeare_tiny --vocab-size 300 > /dev/null || exit 1
  size="--hidden 32 --layers 2 --heads 2 --experts 8 --top-k 2 --expert-ffn 16 --seq-len 32 --device cpu"
  cpu="--device cpu"
  capture=""; micro=2  # (CPU: no CUDA graphs; 2 rows per rank)
  steps=${STEPS:-6}; every=3; rsteps=${REPLACE_STEPS:-40}; revery=10; tmo=120
else
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [ "${DRY_RUN:-0}" != 1 ] && [ "$n" -lt "$gpus" ]; then echo "two_gpu_training.sh: needs $gpus GPUs (found $n); TINY=1 for CPU" >&2; exit 2; fi
  case ${SIZE:-small} in  # small: the published table's model; olmoe: OLMoE-1B-7B's layer shape, 4 layers (fills the GPU)
    small) size="--hidden 1024 --layers 4 --heads 16 --experts 64 --top-k 8 --expert-ffn 512 --seq-len 1024" ;;
    olmoe) size="--hidden 2048 --layers 4 --heads 16 --experts 64 --top-k 8 --expert-ffn 1024 --seq-len 1024" ;;
  esac
  cpu=""
  capture="--captured-step"; micro=4
  steps=${STEPS:-40}; every=20; rsteps=${REPLACE_STEPS:-1500}; revery=300; tmo=120  # the floor's final save of every expert takes ~30 s
  [ "${SIZE:-small}" = olmoe ] && tmo=400  # (no run at this size ended within 120 s: session 31)
fi
mkdir -p "$runs"

train_run() {  # train_run LINK VARIANT GPUS FLAGS...: one occult train run, its summary in OUT/runs/ (TRAIN_ENV: settings)
  local link=$1 v=$2 gpus=$3 env_="${TRAIN_ENV:-}"
  shift 3
  [ "$link" = slow ] && env_="$env_ NCCL_P2P_DISABLE=1"
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" ${link}_$v "* ]]; then return; fi
  if [ "${DRY_RUN:-0}" != 1 ] && [ "$SECONDS" -gt "$budget" ]; then
    echo "== train_${link}_$v: skipped (${SECONDS}s > BUDGET_S=$budget)"; echo "$link $v" >> "$out/skipped.txt"; return
  fi
  local launch=$tr batch=$((8 * gpus)) name="train_${link}_$v"
  [ "$gpus" = 1 ] && launch=python3
  [ "${TINY:-0}" = 1 ] && batch=4
  [ "$rounds" -gt 1 ] && name="${name}_r$round"
  local dir="$runs/$name"
  rm -rf "$dir"
  run "$name" $tmo env $env_ $launch -m occult train --corpus-dir "$data" $size --batch-size $batch \
    --steps $steps --eval-every $every --eval-tokens 8192 --save-every 0 --no-progress --out "$dir" "$@"
  [ "${DRY_RUN:-0}" = 1 ] || env $env_ python3 "$here/_train_summary.py" run "$dir" "$out/runs/$name.json" \
    --link "$link" --variant "$v" --gpus "$gpus"
  [ "${DRY_RUN:-0}" = 1 ] || rm -rf "$dir"/*.safetensors "$dir/checkpoint"  # ~8 GB a run at the GPU size
}

train_part() {
  data=$(train_corpus) || exit 2
  mkdir -p "$out/runs"
  rm -f "$out/skipped.txt"
  run peak 60 python3 "$here/_train_summary.py" peak "$out/peak.json"
  # a job's first run trains on a cold machine (session 39: 15% below the same run warm, steps 41-60 included):
  # a short DDP run first, not counted (WARMUP=0: none)
  if [ "${WARMUP:-1}" = 1 ] && [ "${TINY:-0}" != 1 ] && [ "$gpus" -gt 1 ]; then
    run warmup $tmo $tr -m occult train --corpus-dir "$data" $size --batch-size $((8 * gpus)) --steps 20 \
      --eval-every 0 --save-every 0 --no-progress --out "$runs/warmup" --dispatcher dedup --grad-sync ddp
    [ "${DRY_RUN:-0}" = 1 ] || rm -rf "$runs/warmup"
  fi
  for round in $(seq 1 "$rounds"); do train_round; done
  for link in $links; do
    [ "${DRY_RUN:-0}" = 1 ] || python3 "$here/_train_summary.py" link "$out" "$link" --gpus "$gpus"
  done
}

train_round() {  # every train run once (ROUNDS: the part runs this once a round)
  for link in $links; do  # the runs every ratio needs first
    [ "$link" = nvlink ] && train_run nvlink 1gpu 1
    train_run "$link" floor "$gpus" --ep-size 1
    train_run "$link" dedup_ddp "$gpus" --dispatcher dedup --grad-sync ddp
    train_run "$link" standard_ddp "$gpus" --dispatcher standard --grad-sync ddp
    # issue 53: two interleaved micro-batches a step, the step recorded (sync-free layers: either link)
    [ "${TINY:-0}" = 1 ] || train_run "$link" dedup_twobatch_captured "$gpus" --dispatcher dedup --grad-sync explicit \
      --two-batch --captured-step
    [ "${TINY:-0}" = 1 ] || train_run "$link" floor_captured "$gpus" --ep-size 1 --grad-sync explicit --captured-step
    # issue 53: the step as 4 accumulated micro-batches, recorded: in turn, paired (combined 1F1B), the floor alike
    train_run "$link" dedup_paired_captured "$gpus" --dispatcher dedup --grad-sync explicit --micro-batches $micro \
      --pair-micro-batches $capture
    train_run "$link" dedup_accum_captured "$gpus" --dispatcher dedup --grad-sync explicit --micro-batches $micro $capture
    train_run "$link" floor_accum_captured "$gpus" --ep-size 1 --grad-sync explicit --micro-batches $micro $capture
  done
  if [[ " $links " == *" nvlink "* ]]; then
    train_run nvlink dedup_fsdp "$gpus" --dispatcher dedup --grad-sync fsdp
    # issue 52: one FSDP2 unit for the whole model (FSDP2's hooks once a step: the small model's step waits on the host)
    train_run nvlink dedup_fsdp_model "$gpus" --dispatcher dedup --grad-sync fsdp --fsdp-units model
    # issue 52: FSDP2's gathers and reduce-scatters recorded with the whole step (beside dedup_captured_explicit)
    [ "${TINY:-0}" = 1 ] || train_run nvlink dedup_fsdp_captured "$gpus" --dispatcher dedup --grad-sync fsdp \
      --transport device --captured-step
    # issue 52: eager FSDP2 with the device transport agreeing once a step (session 15: the per-call host agreement
    # held each rank's host at every layer while FSDP2's work put the ranks apart)
    [ "${TINY:-0}" = 1 ] || TRAIN_ENV=OCCULT_AGREEMENT=step train_run nvlink dedup_fsdp_agreestep "$gpus" --dispatcher dedup \
      --grad-sync fsdp --transport device
    train_run nvlink standard_fsdp "$gpus" --dispatcher standard --grad-sync fsdp
    train_run nvlink dedup_device_ddp "$gpus" --dispatcher dedup --grad-sync ddp --transport device  # issue 36: no host wait
    # issue 52: every MoE layer call replayed from CUDA graphs (one GPU: no gain, the host runs ahead there)
    [ "${TINY:-0}" = 1 ] || train_run nvlink dedup_graphs_ddp "$gpus" --dispatcher dedup --grad-sync ddp --transport device \
      --layer-graphs
    # issue 52: the whole step recorded as one CUDA graph (the gradient all-reduce recorded with it: explicit sync)
    [ "${TINY:-0}" = 1 ] || train_run nvlink dedup_captured_explicit "$gpus" --dispatcher dedup --grad-sync explicit \
      --transport device --captured-step
    # "auto" (dedup_ddp) takes the device transport on NVLink: the count exchange beside it
    train_run nvlink dedup_counts_ddp "$gpus" --dispatcher dedup --grad-sync ddp --transport counts
    # FSDP2 cost 21-31 % on NVLink with the count exchange: does a layer with no host wait let it prefetch?
    train_run nvlink dedup_device_fsdp "$gpus" --dispatcher dedup --grad-sync fsdp --transport device
  fi
}

more_part() {
  data=$(train_corpus) || exit 2
  local hf="$runs/hf" ft=${FT_STEPS:-30}
  local hfsize="" ftflags="--data random --steps $ft --save-every 0 --no-progress --seq-len 512 --batch-size 8"
  if [ "${TINY:-0}" = 1 ]; then hfsize=tiny; ftflags="--data random --steps 4 --save-every 0 --no-progress --seq-len 16 --batch-size 4 --device cpu"; fi
  [ "${DRY_RUN:-0}" = 1 ] || { rm -rf "$hf"; python3 "$here/_hf_check.py" make "$hf/src" $hfsize || exit 1; }
  run finetune_hf_1gpu 120 python3 -m occult finetune --hf "$hf/src" --out "$hf/ft1" $ftflags
  run finetune_hf_2gpu 120 $tr2 -m occult finetune --hf "$hf/src" --out "$hf/ft2" $ftflags
  run finetune_hf_check 90 python3 "$here/_hf_check.py" check "$hf" "$out/finetune_hf_2xGPU.json"
  if [ "${TINY:-0}" = 1 ]; then  # the test's own check on CPU gloo ranks (pytest skips it without GPUs)
    run resume_test 150 python3 tests/gpu/test_resume_across_gpu_counts.py --device cpu
  else
    run resume_test 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_resume_across_gpu_counts.py
  fi
  for r in off every; do  # the same run without and with re-placement (plain top-k routing: exact)
    local flags=""; [ $r = every ] && flags="--replace-every $revery --replace-check-every 10"
    rm -rf "$runs/replace_$r"
    run "replace_$r" 150 $tr2 -m occult train --corpus-dir "$data" --hidden 64 --layers 2 --heads 2 --experts 16 \
      --top-k 4 --expert-ffn 64 --seq-len 64 --batch-size 16 --steps $rsteps --eval-every $((rsteps / 2)) \
      --eval-tokens 8192 --save-every 0 --lr 3e-3 --warmup 20 --no-progress $cpu \
      --out "$runs/replace_$r" $flags
  done
  [ "${DRY_RUN:-0}" = 1 ] || python3 "$here/_train_summary.py" replace "$runs/replace_off" "$runs/replace_every" \
    "$out/replacement_2xGPU.json"
}

case $part in train|all) train_part ;; esac
case $part in more|all) more_part ;; esac
[ "${DRY_RUN:-0}" = 1 ] || [ -n "${RUNS_DIR:-}" ] || rm -rf "$runs"
echo "== done in ${SECONDS}s"
