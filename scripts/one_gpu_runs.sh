#!/usr/bin/env bash
# What one GPU can measure for the open issues (multi_gpu_runs.sh has the rest), one part per
# device call, repo root:
#
#   bash scripts/one_gpu_runs.sh PART OUT        PART: kernels | suite | peer | train | layer_graphs | captured_step | optimizer | native | native_decode | quality
#   DRY_RUN=1 bash scripts/one_gpu_runs.sh all /tmp/x   # print the commands
#
# kernels  the expert kernels at four real shapes (benchmarks/bench_kernels.py), fp32 check, and a
#          sweep of the memory-bound passes' tiles (the backward's 75%-of-dense target)       issue 14
# suite    the GPU suite on 2 gloo ranks sharing the GPU (NCCL needs a GPU per rank), and the bf16
#          transformers cases again with the fused Triton dgrad (OCCULT_DGRAD1=triton)         issues 13-15
# peer     whole Qwen3-MoE-shape model on one GPU: occult (no expert-parallel traffic) against
#          TorchTitan 0.3.0's own model, prefill and training step (needs TorchTitan's wheels in
#          .whl/: docs/benchmarks.md, "Reproduce", step 1)                                      issues 14, 15
# train    occult train tokens/s on one GPU (OccultLM, 4 layers, 64 experts top-8): the 1-GPU row of
#          the training throughput table (carry .gpudata: `python -m occult data prepare --out
#          .gpudata --vocab-size 8000` on a machine with network)                               issue 15
# layer_graphs  occult train --layer-graphs against the eager layers, same model as train, 50 steps each
#          (tokens/s of steps 26-50, losses step by step; eager twice: how far two eager runs drift apart; the
#          evaluation at step 50 replays the one recorded at step 25), then 15 steps each with --profile-steps
#          11:15 (host time per MoE layer call) -> OUT/train_layer_graphs_1gpu.json (carry .gpudata)     issue 52
# captured_step  occult train --captured-step against eager steps (and --layer-graphs once), same model as
#          train, 100 steps each, alternated twice in one job (tokens/s of steps 51-100, losses step by step),
#          then 15 steps each with --profile-steps 11:15 (host ms per step and per MoE call)
#          -> OUT/train_captured_step_1gpu.json (carry .gpudata)                                 issue 52
# optimizer  AdamW's fused kernels against AdamW in fp32 and torch's (tests/gpu/test_fused_adamw_one_gpu.py,
#          tests/kernels/test_adamw_kernel.py), occult's step against torch's alone with a block sweep
#          (benchmarks/bench_adamw.py), then occult's step under a training forward on the whole 16-layer OLMoE
#          (scripts/optimizer_overlap_probe.py: how much a deferred update could hide) -> OUT/optimizer_probe.json  issue 52
# native   whole Qwen3-MoE and DeepSeek-V3-shape models against plain transformers, eager and with
#          hf.compile_layers on both, prefill and training step (benchmarks/e2e.py)         issue 26
# native_decode  the same shapes, hf.generate (graph; compile_layers + graph) against transformers'
#          compiled generate, 128-token prompts, 128 new tokens, B = 1, 8, 64 (benchmarks/serve.py);
#          one model per call (MODELS=qwen3, then MODELS=deepseek: ~300-370 s each)           issue 26
# quality  the pruning quality study on one GPU, 4 devices simulated (benchmarks/quality_ranks.py --simulate):
#          hidden 512, 8 layers, 64 experts top-8; by default what one 10-minute call finishes for one seed (about
#          400 s on an H200), the configuration of the published seed 0: N = 2/1 (MAX_DEVICES), score (METHODS), plain
#          fine-tuning of FT_STEPS=100 and the recipes in RECIPES (distill-ft-x4@2,1) with RECIPE_METHODS (score);
#          the whole study: MAX_DEVICES="3 2 1" METHODS="score similarity" RECIPE_METHODS="score similarity"
#          RECIPES="distill-ft-x4@3,2 distill-ft-experts-x8@1" FT_STEPS=200 (several calls a seed). More flags in
#          QUALITY_ARGS. SEEDS=0,1,2 runs one process per seed at once (1.36x the throughput of one), each cut at
#          QUALITY_SECONDS (default 570) and resumed by the next call. Runs live in out/quality-gpu, kept only
#          while the machine stays warm (it is released about 30 s after a call returns: a call cut short must be
#          followed at once, so size a call to finish its seed: docs/quality_ranks.md); every seed's JSON and metrics logs come
#          back under OUT/quality/seedS/: copy them to a run directory's seedS/ and aggregate on the CPU with
#          `python benchmarks/quality_ranks.py --simulate --resume --seeds 0,1,2 ...` (same flags); a seed measured as
#          several runs (e.g. METHODS=score, then METHODS=similarity) is merged first: benchmarks/quality_merge.py
#          (docs/quality_ranks.md has the published study's commands); carry .gpudata                      issue 28
#
# Each command writes JSON or logs under OUT and prints its last lines.
set -uo pipefail
part=${1:?usage: one_gpu_runs.sh PART OUT}
out=${2:?usage: one_gpu_runs.sh PART OUT}
case $part in
  kernels|suite|peer|train|layer_graphs|captured_step|optimizer|native|native_decode|quality|all) ;;
  *) echo "one_gpu_runs.sh: unknown part '$part' (kernels, suite, peer, train, layer_graphs, captured_step, optimizer, native, native_decode, quality, all)" >&2; exit 2 ;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
if [ "${DRY_RUN:-0}" != 1 ] && ! python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  echo "one_gpu_runs.sh: needs a CUDA GPU" >&2
  exit 2
fi
source "$(dirname "$0")/_gpu_runs_common.sh"  # run(), train_corpus()
case $part in
  kernels|all)
    TAIL=40 run kernels 300 python3 benchmarks/bench_kernels.py --sweep swiglu_rows,gather \
      --skip-reference --out "$out/kernels.json" ;;&
  suite|all)
    run suite 330 env OCCULT_GPU_SUITE_BACKEND=gloo bash tests/gpu/run.sh "$out/suite"
    run suite_hf_triton 200 env OCCULT_GPU_SUITE_BACKEND=gloo OCCULT_DGRAD1=triton PYTEST_ARGS="-k converted_model" \
      bash tests/gpu/run.sh "$out/suite_hf_triton"
    [ "${DRY_RUN:-0}" = 1 ] || tar -czf "$out/suite.tgz" -C "$out" suite suite_hf_triton ;;&
  peer|all)
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    run peer_1gpu 400 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/e2e.py --model qwen3 \
      --variants replicated,torchtitan --out "$out/e2e_qwen3_1gpu_peer.json" ;;&
  optimizer|all)
    run fused_adamw_test 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_adamw_one_gpu.py \
      tests/kernels/test_adamw_kernel.py
    run bench_adamw 120 python3 benchmarks/bench_adamw.py --layers 16 --sweep --out "$out/bench_adamw_olmoe16.json"
    run optimizer_probe 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
      scripts/optimizer_overlap_probe.py --layers 16 --variant replicated/compile --out "$out/optimizer_probe.json" ;;&
  native|all)
    for model in qwen3 deepseek; do
      run "e2e_${model}_native" 280 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/e2e.py \
        --model $model --variants native,replicated,replicated/compile,native/compile --warmup 2 --iters 5 \
        --out "$out/e2e_${model}_native_1gpu.json"
    done ;;&
  native_decode|all)
    for model in ${MODELS:-qwen3 deepseek}; do  # one model per call: MODELS=qwen3, then MODELS=deepseek
      for variants in native-generate+compile generate+graph,generate+compile+graph; do
        run "serve_${model}_${variants%%+*}" 280 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
          benchmarks/serve.py --model $model --batch 1,8,64 --prompt-len 128 --new-tokens 128 --repeats 2 \
          --variants $variants --out "$out/serve_${model}_${variants%%+*}_1gpu.json"
      done
    done ;;&
  quality|all)
    data=$(train_corpus) || exit 2
    seeds=${SEEDS:-0}
    for s in ${seeds//,/ }; do  # one process per seed, all at once: the model is too small to fill the GPU alone
      run "quality_seed_$s" ${QUALITY_SECONDS:-570} python3 benchmarks/quality_ranks.py --simulate --ranks 4 --seeds "$s" \
        --corpus-dir $data --hidden 512 --layers 8 --heads 8 --experts 64 --top-k 8 --max-devices ${MAX_DEVICES:-2 1} \
        --methods ${METHODS:-score} --recipes ${RECIPES:-distill-ft-x4@2,1} --recipe-methods ${RECIPE_METHODS:-score} \
        --ft-steps ${FT_STEPS:-100} --expert-backend auto --eval-tokens 262144 --drop-weights ${QUALITY_ARGS:-} \
        --out out/quality-gpu --resume &
    done
    wait
    if [ "${DRY_RUN:-0}" != 1 ]; then  # every JSON and metrics log (no weights): a seed cut short still reports its runs
      mkdir -p "$out/quality" && dest=$(cd "$out/quality" && pwd)  # absolute: OUT may be either
      for s in ${seeds//,/ }; do
        (cd out/quality-gpu && find "seed$s" -name '*.json*' -size -5M -exec cp --parents {} "$dest/" \;)
      done
    fi ;;&
  train|all)
    data=$(train_corpus) || exit 2
    run train_1gpu 200 python3 -m occult train --corpus-dir $data --hidden 1024 --layers 4 --heads 16 --experts 64 \
      --top-k 8 --expert-ffn 512 --seq-len 1024 --batch-size 8 --steps 40 --eval-every 20 --eval-tokens 16384 \
      --save-every 0 --no-progress --out /tmp/occult_train_1gpu
    [ "${DRY_RUN:-0}" = 1 ] || python3 -c "import json,sys; m=[json.loads(l) for l in open(sys.argv[1])][-1]; \
json.dump(dict(m, link='none', variant='floor', gpus=1), open(sys.argv[2], 'w'))" \
      /tmp/occult_train_1gpu/metrics.jsonl "$out/train_1gpu.json" ;;&
  layer_graphs|all)
    data=$(train_corpus) || exit 2
    lm="--corpus-dir $data --hidden 1024 --layers 4 --heads 16 --experts 64 --top-k 8 --expert-ffn 512 --seq-len 1024 \
      --batch-size 8 --save-every 0 --no-progress"
    for mode in eager graphs eager_repeat; do  # the repeat: how far two eager runs of one seed drift apart
      flag=""; [ $mode = graphs ] && flag=--layer-graphs
      rm -rf "/tmp/occult_lg_$mode"
      run "train_$mode" 200 python3 -m occult train $lm --steps 50 --eval-every 25 --eval-tokens 32768 $flag \
        --out "/tmp/occult_lg_$mode"
    done
    for mode in eager graphs; do
      flag=""; [ $mode = graphs ] && flag=--layer-graphs
      rm -rf "/tmp/occult_lgp_$mode"
      run "profile_$mode" 150 python3 -m occult train $lm --steps 15 --eval-every 0 --profile-steps 11:15 $flag \
        --out "/tmp/occult_lgp_$mode"
    done
    [ "${DRY_RUN:-0}" = 1 ] || python3 scripts/_train_summary.py graphs /tmp/occult_lg_eager /tmp/occult_lg_graphs \
      /tmp/occult_lg_eager_repeat /tmp/occult_lgp_eager /tmp/occult_lgp_graphs "$out/train_layer_graphs_1gpu.json" ;;&
  captured_step|all)
    data=$(train_corpus) || exit 2
    lm="--corpus-dir $data --hidden 1024 --layers 4 --heads 16 --experts 64 --top-k 8 --expert-ffn 512 --seq-len 1024 \
      --batch-size 8 --save-every 0 --no-progress"
    named=()
    for name in eager_1 captured_1 graphs_1 eager_2 captured_2; do  # alternated: drift on the host hits every mode
      case $name in captured*) flag=--captured-step ;; graphs*) flag=--layer-graphs ;; *) flag="" ;; esac
      rm -rf "/tmp/occult_cs_$name"
      run "train_$name" 200 python3 -m occult train $lm --steps 100 --eval-every 50 --eval-tokens 32768 $flag \
        --out "/tmp/occult_cs_$name"
      named+=("$name=/tmp/occult_cs_$name")
    done
    for name in eager captured; do
      flag=""; [ $name = captured ] && flag=--captured-step
      rm -rf "/tmp/occult_csp_$name"
      run "profile_$name" 150 python3 -m occult train $lm --steps 15 --eval-every 0 --profile-steps 11:15 $flag \
        --out "/tmp/occult_csp_$name"
      named+=("profile_$name=/tmp/occult_csp_$name")
    done
    [ "${DRY_RUN:-0}" = 1 ] || python3 scripts/_train_summary.py ab "$out/train_captured_step_1gpu.json" "${named[@]}" ;;
esac
