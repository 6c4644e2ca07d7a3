#!/usr/bin/env bash
# Issue 37's hang at exit, one configuration per run (2 GPUs, each bounded): which step before
# dist.destroy_process_group() lets a compile_layers + graph-decode run end names the cause. The layers
# take "auto" (the device transport on NVLink: no NCCL collective in the decode graph) except in the
# counts configurations (sync-free NCCL decode: captured NCCL collectives, as on a slow link).
#   bash scripts/exit_probe_matrix.sh OUT [NAME ...]     (default: every configuration, in this order)
set -uo pipefail
out=${1:?usage: exit_probe_matrix.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
tr="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
probe() {  # probe NAME FLAGS...
  local name=$1; shift
  local t0=$SECONDS
  timeout -k 5 70 $tr scripts/exit_probe.py --layers 2 "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s: $*" | tee -a "$out/summary.txt"
}
declare -A flags=([baseline]="" [release]="--before release" [workers]="--before workers-shutdown"
                   [no_graph]="--no-graph" [dynamo]="--before dynamo-reset" [no_compile]="--no-compile"
                   [counts]="--transport counts" [counts_finish]="--transport counts --teardown finish")
shift
names=("$@"); [ ${#names[@]} -gt 0 ] || names=(baseline release workers no_graph dynamo no_compile counts counts_finish)
for name in "${names[@]}"; do
  [ -n "${flags[$name]+x}" ] || { echo "exit_probe_matrix.sh: unknown configuration '$name' (${!flags[*]})" >&2; exit 2; }
  probe "$name" ${flags[$name]}
done
