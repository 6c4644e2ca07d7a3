#!/usr/bin/env bash
# One device call: correctness smoke, the demo on all GPUs, and `occult bench` on 1, 2 and N GPUs.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_bench.sh OUTDIR
set -uo pipefail
out=${1:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
fi
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
echo "GPUs: $n"
timeout 120 python3 -m occult.cli demo --steps 5 2>&1 | tee "$out/demo.txt"
shapes=${SHAPES:-olmoe,qwen3,deepseek,mixtral}
timeout ${BENCH_TIMEOUT:-300} python3 -m occult.cli bench --world-size "$n" --shapes "$shapes" --tokens 8192 --out "$out/bench_${n}gpu.json" 2>&1 | tee "$out/bench_${n}gpu.txt"
if [ "$n" -gt 2 ]; then
  timeout 100 python3 -m occult.cli bench --world-size 2 --shapes olmoe,deepseek --tokens 8192 --routing random --out "$out/bench_2gpu.json" 2>&1 | tee "$out/bench_2gpu.txt"
fi
timeout 60 python3 -m occult.cli bench --world-size 1 --shapes olmoe --tokens 8192 --routing random --variants standard,dedup --out "$out/bench_1gpu.json" 2>&1 | tee "$out/bench_1gpu.txt"
