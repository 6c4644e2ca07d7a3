#!/usr/bin/env bash
# Issue 39's runs on one 4-GPU machine (nvidia-h100-x4 / nvidia-h200-x4), one part per device call
# (each sized for the device tool's 10-minute limit). Repo root:
#
#   bash scripts/four_gpu_runs.sh PART OUT      PART: olmoe | olmoe-slow-floor | qwen3 | layer | serve | serve-graph
#   DRY_RUN=1 bash scripts/four_gpu_runs.sh all /tmp/x   # print every command (all: more than one call holds)
#
# olmoe   benchmarks/e2e.py, OLMoE shape, NVLink then NCCL_P2P_DISABLE=1 (the replicated floor sends no
#         expert rows, but its training all-reduces the dense gradients: it is measured on both links)
# qwen3   the same for the Qwen3-MoE shape, with TorchTitan's own model and TorchTitan + occult
#         (TorchTitan's wheels in .whl/: docs/benchmarks.md, "Reproduce", step 1)
# layer   `occult bench` on 1, 2 and 4 GPUs (OLMoE, flat and two-level `dedup2 --nodes 2`): the cost
#         model is fitted on 1-2 GPUs and checked against 4 (benchmarks/cost_check.py, run after)
# serve   benchmarks/serve.py at B=1 and B=64 per GPU, NVLink: EP decode against the replicated floor
#         and transformers' compiled generate (serve-graph: graph-captured floor and EP only, no compile)
#
# Routing with a trained model's co-activation structure: the routers are drawn from the trace of an
# OccultLM trained on Shakespeare (benchmarks/_router_trace.py; TRACE_OLMOE 64 experts, TRACE_QWEN3
# 128, top-8: docs/fourgpu.md, "How the routing gets a trained model's structure" and "Reproduce",
# says how they were made). NVLink multicast stays off.
set -uo pipefail
part=${1:?usage: four_gpu_runs.sh PART OUT}
out=${2:?usage: four_gpu_runs.sh PART OUT}
case $part in
  olmoe|olmoe-slow-floor|qwen3|layer|serve|serve-graph|all) ;;
  *) echo "four_gpu_runs.sh: unknown part '$part' (olmoe, olmoe-slow-floor, qwen3, layer, serve, serve-graph, all)" >&2
     exit 2 ;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
n=${GPUS:-4}
source "$(dirname "$0")/_gpu_runs_common.sh"  # run()
tr="python3 -m torch.distributed.run --standalone --nproc-per-node $n"
TRACE_OLMOE=${TRACE_OLMOE:-docs/results/fourgpu/lm_trace_e64_k8.safetensors}
TRACE_QWEN3=${TRACE_QWEN3:-docs/results/fourgpu/lm_trace_e128_k8.safetensors}
steps="--warmup 2 --iters 8"
occult_variants=standard,dedup,dedup/compile,dedup+placement,pruned2,pruned1
case $part in
  olmoe|all)
    run e2e_olmoe_nvlink 330 $tr benchmarks/e2e.py --model olmoe --router-trace "$TRACE_OLMOE" $steps \
      --variants replicated,replicated/compile,$occult_variants --out "$out/e2e_olmoe_nvlink.json"
    run e2e_olmoe_slow 240 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model olmoe --router-trace "$TRACE_OLMOE" \
      $steps --variants replicated,replicated/compile,$occult_variants --out "$out/e2e_olmoe_slow.json" ;;&
  olmoe-slow-floor|all)  # the slow link's compiled floor alone (the first 4-GPU call left it out)
    run e2e_olmoe_slow_floor 150 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model olmoe \
      --router-trace "$TRACE_OLMOE" $steps --variants replicated/compile --out "$out/e2e_olmoe_slow_floor.json" ;;&
  qwen3|all)
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    run e2e_qwen3_nvlink 300 $tr benchmarks/e2e.py --model qwen3 --router-trace "$TRACE_QWEN3" $steps \
      --variants replicated,replicated/compile,$occult_variants,torchtitan,torchtitan+occult --out "$out/e2e_qwen3_nvlink.json"
    run e2e_qwen3_slow 240 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model qwen3 --router-trace "$TRACE_QWEN3" \
      $steps --variants replicated,replicated/compile,$occult_variants,torchtitan,torchtitan+occult \
      --out "$out/e2e_qwen3_slow.json" ;;&
  layer|all)
    for ws in 1 2 4; do
      vars=standard,dedup,dedup+placement; [ $ws = 4 ] && vars=$vars,dedup2; [ $ws = 1 ] && vars=dedup
      nodes=1; [ $ws = 4 ] && nodes=2
      run "bench_${ws}gpu" 150 python3 -m occult bench --world-size $ws --shapes olmoe,qwen3 --tokens 8192 \
        --variants $vars --nodes $nodes --iters 10 --out "$out/bench_${ws}gpu.json"
    done ;;&
  serve|all)
    run serve_olmoe_nvlink 280 $tr benchmarks/serve.py --model olmoe --batch 1,64 --prompt-len 128 --new-tokens 32 \
      --repeats 2 --variants native-generate+compile,replicated+compile+graph,generate+graph,generate+compile+graph \
      --out "$out/serve_olmoe_nvlink.json" ;;&
  serve-graph|all)  # EP decode against the floor without compile (quick: no compile of either)
    run serve_graph_olmoe_nvlink 110 $tr benchmarks/serve.py --model olmoe --batch 1,64 --prompt-len 128 --new-tokens 32 \
      --repeats 2 --variants replicated+graph,generate+graph --out "$out/serve_graph_olmoe_nvlink.json" ;;&
esac
