#!/usr/bin/env bash
# One GPU, two occult trees side by side (issue 25's "same speed" check): the whole OLMoE-1B-7B-shape
# model (16 layers, bf16, 4 x 2048 tokens; benchmarks/e2e.py variant dedup on one rank) prefill and
# training step, and one layer (occult bench --world-size 1), each tree's processes interleaved.
#   git archive COMMIT occult benchmarks | tar -x -C OLD     # the older tree
#   bash scripts/same_speed.sh OLD OUT [ROUNDS]
# Prints one table (median over rounds of each process's median) and writes every JSON under OUT.
set -euo pipefail
old=$(cd "$1" && pwd); out=$2; rounds=${3:-2}
mkdir -p "$out"; out=$(cd "$out" && pwd)
new=$(cd "$(dirname "$0")/.." && pwd)
# (E2E_ARGS / BENCH_ARGS replace the sizes, e.g. for a CPU smoke run: E2E_ARGS="--model tiny --batch 2 --seq 32")
read -r -a sizes <<< "${E2E_ARGS:---model olmoe --layers 16 --batch 4 --seq 2048 --warmup 3 --iters 10}"
read -r -a layer <<< "${BENCH_ARGS:---shapes olmoe --warmup 5 --iters 20}"
e2e=("${sizes[@]}" --variants dedup --phases prefill,train)
bench=(bench --world-size 1 --routing random --variants standard,dedup "${layer[@]}")
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    dir=$old; [ "$side" = new ] && dir=$new
    (cd "$dir" && PYTHONPATH=$dir python -m torch.distributed.run --standalone --nproc-per-node 1 \
        benchmarks/e2e.py "${e2e[@]}" --out "$out/e2e_${side}_$r.json" > "$out/e2e_${side}_$r.log" 2>&1) \
      || { echo "e2e $side round $r failed: $out/e2e_${side}_$r.log"; tail -20 "$out/e2e_${side}_$r.log"; exit 1; }
    (cd "$dir" && PYTHONPATH=$dir python -m occult "${bench[@]}" --out "$out/bench_${side}_$r.json" \
        > "$out/bench_${side}_$r.log" 2>&1) \
      || { echo "bench $side round $r failed: $out/bench_${side}_$r.log"; tail -20 "$out/bench_${side}_$r.log"; exit 1; }
  done
done
python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def e2e(side, phase):
    vals = []
    for r in range(1, rounds + 1):
        doc = json.load(open(f"{out}/e2e_{side}_{r}.json"))
        vals.append(doc["variants"]["dedup"]["phases"][phase]["ms_median"])
    return statistics.median(vals)
def bench(side, variant, key):
    vals = []
    for r in range(1, rounds + 1):
        runs = json.load(open(f"{out}/bench_{side}_{r}.json"))["runs"]
        vals += [x[key] for x in runs if x["variant"] == variant]
    return statistics.median(vals)
rows = [(f"model {p}", e2e("old", p), e2e("new", p)) for p in ("prefill", "train")]
rows += [(f"layer {v} {k}", bench("old", v, k), bench("new", v, k)) for v in ("standard", "dedup")
         for k in ("forward_ms", "fwd_bwd_ms")]
print(f"{'measure':<28}{'old ms':>10}{'new ms':>10}{'new/old':>9}")
for name, a, b in rows:
    print(f"{name:<28}{a:>10.2f}{b:>10.2f}{b / a:>9.3f}")
json.dump({n: {"old_ms": a, "new_ms": b} for n, a, b in rows}, open(f"{out}/same_speed.json", "w"), indent=1)
PY
