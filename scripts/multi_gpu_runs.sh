#!/usr/bin/env bash
# Every multi-GPU measurement the open issues still need, one part per device call (each part is
# sized for the device tool's 10-minute limit). Run on a machine with 2 or 4 GPUs, repo root:
#
#   bash scripts/multi_gpu_runs.sh PART OUT        PART: suite | e2e | e2e-slow | graph | decode | publish | publish-slow | current | current-slow | issue52 | defer | twobatch | interleave | pair | grid | trace | titan | titan-slow | titan-slow-compiled | titan-profile | placed-slow | host-slow | host-profile | host-stall | peer | train | train-slow | serve | serve-slow | probe | scale
#   DRY_RUN=1 bash scripts/multi_gpu_runs.sh all /tmp/x   # print the commands of every part
#
# suite     the GPU suite over NCCL, one rank per GPU (two-level cases need 4 GPUs)     issues 14-18
#           (whole it passes a 10-minute call: OCCULT_GPU_SUITE_STAGES=1a, =1b, ='2 3', one call each)
# e2e       whole OLMoE-shape model, NVLink: floor, standard, dedup, placement, pruned  issue 14
# e2e-slow  the same with NCCL_P2P_DISABLE=1 (~31 GB/s all-to-all)                      issue 14
#           (the overlap schedules' part is gone: they never won, docs/overlap.md)
# graph     issue 36's question: does the layer reach its floor once the host is out of the way? One
#           layer on both transports (occult bench); whole OLMoE-shape and Qwen3-shape prefill with the
#           device transport, eager and captured in one CUDA graph, against the replicated floor eager,
#           compiled and captured (NVLink); TorchTitan and TorchTitan + occult over the device transport
#           (carry .whl for it); the compiled layers captured too (/compile/graph)
#           (and each MoE layer replayed from its own graphs: /layergraphs, @device/graph)
# decode    decode steps over the device transport (issue 37), B = 1 and 64, against sync-free and the floor
# publish   issue 36's publication set on one link: e2e.py, prefill and training, OLMoE and Qwen3 shapes
#           (MODELS=olmoe or qwen3 for one a call, ~5 min each): replicated, replicated/compile, standard,
#           dedup (transport auto: the device transport on NVLink), dedup/compile (+ layer graphs);
#           Qwen3 also torchtitan, torchtitan+occult (carry .whl); publish-slow: NCCL_P2P_DISABLE=1 (auto
#           then takes the count exchange, whose host wait rules out layer graphs; so also the sync-free
#           layer replayed from its graphs, dedup@syncfree/layergraphs/compile)
# current   issues 52 and 53 as they stand: each whole-model target's fastest variant so far beside its floor, one job
#           per model and phase (both carry the back-to-back times; carry .whl for TorchTitan; ~7 min on 2 GPUs):
#           training (replicated/compile/stepgraph, dedup@syncfree/compile/stepgraph/deferwgrad; Qwen3 also
#           torchtitan and torchtitan/compile) and prefill (replicated/compile/graph, dedup@syncfree/compile/graph,
#           dedup@device/compile), NVLink
# current-slow  the same targets under NCCL_P2P_DISABLE=1 (~7 min on 2 GPUs): prefill as K = 4 interleaved
#           micro-batches on the host transport (OLMoE with the trained trace's routing: carry TRACE as for
#           placed-slow), training as two halves on the host transport with the dense sync in the backward
# issue52   issue 52's training targets, NVLink, one model a call (MODELS=olmoe, then MODELS=qwen3; ~7 min
#           each): e2e.py prefill and train against the floor of today's code (replicated/compile: one-rank
#           MoE blocks traced into their layers), the EP layers eager (dedup@device/compile) and replayed
#           (dedup@device/traingraphs/compile), the whole step captured (replicated/compile/stepgraph,
#           dedup@device/compile/stepgraph), then the EP variants again with OCCULT_AGREEMENT=step (the
#           step agreement: default if it wins, removed if not); Qwen3 also torchtitan, torchtitan+occult@device,
#           torchtitan+occult+experts@device (carry .whl). The 2-GPU occult train set: two_gpu_training.sh
# defer     issue 53: the expert weight GEMMs under the dispatch's backward all-to-all (e2e.py's /deferwgrad:
#           OCCULT_DEFER_WGRAD=1 for that variant), OLMoE train, NVLink then the slow link (~5 min each): the
#           fastest EP variants with and without it and the floor in one job (docs/overlap.md, "Deferred
#           weight gradients")
# twobatch  issue 53: the training step as two interleaved micro-batches (e2e.py's /stepgraph/twobatch,
#           occult.training.two_batch), OLMoE train, NVLink then the slow link (~5 min each): the floor, the
#           sync-free step captured with one batch and with two halves (each with and without /deferwgrad), and on NVLink
#           the device transport's captured step beside them (docs/overlap.md, "Two interleaved micro-batches");
#           MODELS="olmoe qwen3" for both shapes, LINKS=slow for one link; ORTHO=1 adds a job per link with a
#           greedy placement and pruning to one device per token, each with one batch and with two halves (with
#           the deferral); OVERLAP=1 a job per link with every variant's dense gradients all-reduced during the
#           backward (and the ORTHO job with them too)
# interleave issue 53: prefill as 2 and 4 interleaved micro-batches (e2e.py's /twobatch, /interleave4: more
#           compute under each exchange, GEMMs of 1/K the rows; e2e.py's 4 x 2048 tokens, so one sequence each)
#           beside one captured batch and the floor, one job per link (LINKS="nvlink slow" by default, MODELS=olmoe
#           by default; ~1-2 min each on 2 GPUs); K = 4 won over the slow link in session 28 (docs/overlap.md,
#           "K interleaved micro-batches")
# pair      issue 53: the train step as 4 accumulated micro-batches of 2 x 2048 tokens (--batch 8 --accumulate 4), in
#           turn and paired (/1f1b: micro-batch i+1's forward with micro-batch i's backward, combined 1F1B), the
#           floor accumulating the same, one job per link (LINKS, MODELS as above; ~2 min each on 2 GPUs); paired
#           won on both links in session 28 (docs/overlap.md, "Combined 1F1B"); OVERLAP=1 adds a job per link with
#           the dense gradients all-reduced in buckets during the last backward (--dense-sync overlap)
# grid      issue 53: the expert GEMMs persistent (the default) and one program per tile (e2e.py's /tilegrid:
#           OCCULT_KERNEL_GRID=tiles for that variant) side by side in one job with the floor: the slow link's
#           training schedules (OLMoE and Qwen3 halves, OLMoE paired x4; --dense-sync overlap) and K = 4 prefill,
#           NVLink's one-batch step (on 2 GPUs ~6 min for LINKS=slow, ~1.5 for LINKS=nvlink); tiles won the slow-link
#           training schedules in session 29 (docs/overlap.md, "One program per tile")
# trace     issue 52: sync-free expert-parallel MoE blocks traced into their decoder layers (e2e.py's /tracemoe:
#           compile_layers(trace_moe=True), all-to-alls in the layers' graphs): the GPU suite's traced cases
#           (-k 'traced_sync_free or compiled_exchange': against eager in three dtypes, no graph break; one
#           compiled exchange's gradients), then OLMoE and Qwen3 training (each variant's MoE backward checked first)
#           (NVLink) and OLMoE prefill in one job each with the floor and the same variants eager between the
#           layers' graphs (~7 min on 2 GPUs; docs/training.md, "Sync-free expert-parallel MoE blocks traced");
# titan     issue 52: TorchTitan's Qwen3 (train) eager and with its blocks compiled (/compile, as its apply_compile),
#           beside the same with occult's sync-free dispatcher and fused experts (torchtitan+occult+experts@syncfree,
#           eager and /compile) and occult's own fastest step, one job (carry .whl; a call of its own: ~8 min cold,
#           FlexAttention autotuned at each compile), then the same with occult recorded as TorchTitan's trainer
#           records a step (/stepgraph: eager, compiled; last). titan-slow: under NCCL_P2P_DISABLE=1 in two jobs,
#           each a call of its own (the seven variants passed 570 s there): titan-slow the eager pair and occult's
#           fastest (two-batch) step, titan-slow-compiled the compiled pair and the recorded step beside
#           TorchTitan's fastest (its compiled one)
# titan-profile  issue 52: where those train steps go (scripts/profile_model.py, NVLink, 3 steps each: wall against
#           GPU busy, exchanges and what runs under them, kernel families; timelines under OUT/titan_profile):
#           TorchTitan's fastest (compiled), TorchTitan + occult recorded and compiled, occult's own fastest (the
#           compiled e2e.py variants took 70-90 s each on 2 x H200: three fit a call)
# placed-slow  issue 53: what placement buys the slow link's prefill where routing has a trained model's
#           co-activation structure (e2e.py --router-trace TRACE, default the OccultLM trace of 64 experts top-8
#           under docs/results/fourgpu/: carry it, the snapshot of occult/tests/benchmarks/scripts lacks docs/):
#           OLMoE, NCCL_P2P_DISABLE=1, the floor, dedup and dedup+placement four interleaved micro-batches, the
#           pruned1 without and with its sync-free blocks bounded (/capN, ExecConfig.sync_free_capacity: PRUNED_CAP),
#           then in a job of its own dedup+placement bounded (CAP): without a bound a sync-free exchange sends T rows
#           to each other rank, whatever placement or pruning saves
# host-slow issue 53: the host transport (transport="host": the all-to-alls through shared pinned host memory by
#           copy engines) against NCCL on the slow link, one job per model and phase: prefill K = 2 and 4 interleaved
#           micro-batches (OLMoE with the trained trace's routing: carry TRACE as for placed-slow), the training step
#           as halves (deferred weight gradients, dense sync in the backward), one batch, and paired x4 (/1f1b)
# host-profile issue 53: a profile per host-transport schedule against its floor (scripts/profile_model.py --traces,
#           slow link, 5 steps, random routing): prefill K = 4, halves, paired x4, one model a call (MODELS, default
#           qwen3; ~5 min on 2 GPUs), then each rank-0 timeline's compute idle by what runs under it
#           (scripts/trace_exchanges.py; docs/overlap.md, "The host transport, round 2")
# host-stall issue 53: the host halves' stall behind the LM head's gradient all-reduce (docs/overlap.md, "The host
#           transport, round 3"): per model (MODELS, default qwen3 olmoe) a profile of the floor and the host halves
#           with CUDA_DEVICE_MAX_CONNECTIONS=8 and =32 (the GPU's hardware work queues), then each rank-0 timeline's
#           stretches of >= 1 ms with no compute kernel (trace_exchanges.py --stalls 1); ~4 min on 2 GPUs
# peer      Qwen3-MoE shape against TorchTitan's own whole model (EP + FSDP2), both links  issues 14, 15
#           (needs TorchTitan's wheels in .whl/: docs/benchmarks.md, "Reproduce", step 1)
# train     occult train (OccultLM, 4 layers, 64 experts top-8) tokens/s per GPU: EP size 1 (floor),
#           standard, dedup (train-slow: the same with NCCL_P2P_DISABLE=1)               issue 15
#           (carry .gpudata: `python -m occult data prepare --out .gpudata --vocab-size 8000`)
# serve     decode and serving, OLMoE and Qwen3 shapes, B = 1-256 per GPU: transformers' compiled generate,
#           the replicated floor (compiled, captured) and occult EP generate (compiled, captured; "auto": the
#           device transport on NVLink), NVLink (SERVE_VARIANTS, SERVE_BATCH override the lists)
#           (serve-slow: NCCL_P2P_DISABLE=1); then benchmarks/serve_plot.py: table and plot    issues 16, 37
# probe     host syncs of a layer (find_syncs.py); layer bench                           issues 14, 16
# scale     one migration of the OLMoE-shape expert state; two-level dispatch (4 GPUs)   issues 17, 18
#           (the re-placement training report, ~20 min: docs/replacement.md)
#
# Every command writes JSON under OUT and prints its table last; then the targets table of all JSON in
# OUT (scripts/targets_report.py, also OUT/targets.md). NVLink multicast stays off.
set -uo pipefail
part=${1:?usage: multi_gpu_runs.sh PART OUT}
out=${2:?usage: multi_gpu_runs.sh PART OUT}
case $part in  # checked first: the parts below fall through (;;&), so a catch-all there would match every part
  suite|e2e|e2e-slow|graph|decode|publish|publish-slow|current|current-slow|issue52|defer|twobatch|interleave|pair|grid|trace|titan|titan-slow|titan-slow-compiled|titan-profile|placed-slow|host-slow|host-profile|host-stall|peer|train|train-slow|serve|serve-slow|probe|scale|all) ;;
  *) echo "multi_gpu_runs.sh: unknown part '$part' (suite, e2e, e2e-slow, graph, decode, publish, publish-slow, current, current-slow, issue52, defer, twobatch, interleave, pair, grid, trace, titan, titan-slow, titan-slow-compiled, titan-profile, placed-slow, host-slow, host-profile, host-stall, peer, train, train-slow, serve, serve-slow, probe, scale, all)" >&2
     exit 2 ;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
n=4  # a dry run prints the 4-GPU commands without asking torch
[ "${DRY_RUN:-0}" = 1 ] || n=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${DRY_RUN:-0}" != 1 ] && [ "$n" -lt 2 ]; then
  echo "multi_gpu_runs.sh: needs 2+ GPUs (found $n)" >&2
  exit 2
fi
[ "$n" -ge 2 ] || n=4
source "$(dirname "$0")/_gpu_runs_common.sh"  # run(), train_corpus()
tr="python3 -m torch.distributed.run --standalone --nproc-per-node $n"
e2e_all=replicated,standard,dedup,dedup+placement,pruned2,pruned1
case $part in
  suite|all)
    run suite 560 bash tests/gpu/run.sh "$out/suite" ;;&
  e2e|all)
    run e2e_nvlink 560 $tr benchmarks/e2e.py --model olmoe --variants $e2e_all --out "$out/e2e_${n}gpu.json" ;;&
  e2e-slow|all)
    run e2e_slow 560 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model olmoe \
      --variants replicated,standard,dedup,dedup+placement --out "$out/e2e_${n}gpu_nop2p.json" ;;&
  graph|all)
    run bench_transport 100 python3 -m occult.cli bench --world-size "$n" --shapes olmoe,qwen3 --routing random \
      --variants dedup,dedup@device,dedup@device/graph,standard,standard@device/graph --tokens 512,8192 \
      --out "$out/bench_transport_${n}gpu.json"
    run graph_olmoe 200 $tr benchmarks/e2e.py --model olmoe --phases prefill \
      --variants replicated/compile,replicated/layergraphs/compile,replicated/compile/graph,dedup@device/layergraphs/compile,dedup@device/compile/graph \
      --out "$out/e2e_graph_olmoe_${n}gpu.json"
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then  # TorchTitan for its +occult@device row (peer part: the wheels)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    run graph_qwen3 230 $tr benchmarks/e2e.py --model qwen3 \
      --variants replicated/compile,replicated/compile/graph,dedup/compile,dedup@device/graph,dedup@device/compile/graph,torchtitan,torchtitan+occult,torchtitan+occult@device \
      --out "$out/e2e_graph_qwen3_${n}gpu.json" ;;&
  decode|all)
    run decode_device 150 $tr benchmarks/serve.py --model olmoe --batch 1,64 --prompt-len 128 --new-tokens 32 --repeats 3 \
      --variants replicated+graph,dedup-syncfree+graph,dedup@device+graph,generate+graph,generate@device+graph \
      --out "$out/decode_device_olmoe_${n}gpu.json" ;;&
  publish|publish-slow|all)  # issue 36's e2e set (docs/results/twogpu/e2e_{model}_{link}_2x{card}.json)
    links="nvlink slow"; [ "$part" = publish ] && links=nvlink; [ "$part" = publish-slow ] && links=slow
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    for link in $links; do
      env_=""; [ $link = slow ] && env_="NCCL_P2P_DISABLE=1"
      for model in ${MODELS:-olmoe qwen3}; do
        variants=replicated,replicated/compile,standard,dedup,dedup/compile
        [ $link = slow ] && variants=$variants,dedup@syncfree/layergraphs/compile
        [ $model = qwen3 ] && variants=$variants,torchtitan,torchtitan+occult
        run "publish_${model}_$link" "${PUBLISH_TIMEOUT_S:-540}" env $env_ $tr benchmarks/e2e.py --model $model \
          --variants $variants --out "$out/e2e_${model}_${link}_${n}gpu.json"
      done
    done ;;&
  current|all)  # issues 52 and 53, NVLink: every whole-model target's fastest variant so far beside its floor
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    for model in ${MODELS:-olmoe qwen3}; do
      train=replicated/compile/stepgraph,dedup@syncfree/compile/stepgraph/deferwgrad
      [ $model = qwen3 ] && train=$train,torchtitan,torchtitan/compile
      run "current_${model}_train_nvlink" 330 $tr benchmarks/e2e.py --model $model --phases train --variants $train \
        --out "$out/e2e_${model}_train_current_nvlink_${n}gpu.json"
      run "current_${model}_prefill_nvlink" 200 $tr benchmarks/e2e.py --model $model --phases prefill \
        --variants replicated/compile/graph,dedup@syncfree/compile/graph,dedup@device/compile \
        --out "$out/e2e_${model}_prefill_current_nvlink_${n}gpu.json"
    done ;;&
  current-slow|all)  # the same targets on the slow link: the host transport's schedules
    trace=${TRACE:-docs/results/fourgpu/lm_trace_e64_k8.safetensors}
    for model in ${MODELS:-olmoe qwen3}; do
      routing=""; [ $model = olmoe ] && routing="--router-trace $trace"
      run "current_${model}_prefill_slow" 200 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model $model \
        --phases prefill $routing --variants replicated/compile/graph,dedup@host/compile/interleave4 \
        --out "$out/e2e_${model}_prefill_current_slow_${n}gpu.json"
      run "current_${model}_train_slow" 240 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model $model --phases train \
        --dense-sync overlap --variants replicated/compile/stepgraph,dedup@host/compile/stepgraph/twobatch/deferwgrad \
        --out "$out/e2e_${model}_train_current_slow_${n}gpu.json"
    done ;;&
  issue52|all)  # issue 52's training targets against today's floor (docs/training.md)
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    ep=dedup@device/compile,dedup@device/traingraphs/compile
    for model in ${MODELS:-olmoe qwen3}; do
      # /stepgraph: the whole training step recorded as one CUDA graph (not with the step agreement: host work)
      variants=replicated/compile,replicated/compile/stepgraph,$ep,dedup@device/compile/stepgraph
      [ $model = qwen3 ] && variants=$variants,torchtitan,torchtitan+occult@device,torchtitan+occult+experts@device
      run "issue52_${model}" 400 $tr benchmarks/e2e.py --model $model --phases prefill,train --variants $variants \
        --out "$out/e2e_${model}_issue52_${n}gpu.json"
      run "issue52_${model}_step" 150 env OCCULT_AGREEMENT=step $tr benchmarks/e2e.py --model $model --phases train \
        --variants replicated/compile,$ep --out "$out/e2e_${model}_issue52_step_${n}gpu.json"
    done ;;&
  defer|all)  # issue 53: deferred expert weight gradients (/deferwgrad), with and without in one job per link
    for link in nvlink slow; do
      env_=""; how=device
      [ $link = slow ] && env_="NCCL_P2P_DISABLE=1" && how=syncfree
      ep=dedup@$how/compile,dedup@$how/compile/deferwgrad,dedup@$how/compile/stepgraph,dedup@$how/compile/stepgraph/deferwgrad
      run "defer_olmoe_$link" 400 env $env_ $tr benchmarks/e2e.py --model olmoe --phases train \
        --variants replicated/compile,$ep --out "$out/e2e_olmoe_defer_${link}_${n}gpu.json"
    done ;;&
  twobatch|all)  # issue 53: the training step's two halves interleaved (/stepgraph/twobatch), one job per link
    for model in ${MODELS:-olmoe}; do
      for link in ${LINKS:-nvlink slow}; do
        env_=""; extra=",dedup@device/compile/stepgraph"
        [ $link = slow ] && env_="NCCL_P2P_DISABLE=1" && extra=""
        one=dedup@syncfree/compile/stepgraph
        run "twobatch_${model}_$link" 450 env $env_ $tr benchmarks/e2e.py --model $model --phases train \
          --variants replicated/compile/stepgraph,$one,$one/twobatch,$one/deferwgrad,$one/twobatch/deferwgrad$extra \
          --out "$out/e2e_${model}_twobatch_${link}_${n}gpu.json"
        # OVERLAP=1: the same variants with the dense gradients all-reduced during the backward (--dense-sync overlap)
        [ "${OVERLAP:-0}" = 1 ] && run "twobatch_${model}_${link}_overlap" 450 env $env_ $tr benchmarks/e2e.py \
          --model $model --phases train --dense-sync overlap \
          --variants replicated/compile/stepgraph,$one,$one/twobatch,$one/deferwgrad,$one/twobatch/deferwgrad \
          --out "$out/e2e_${model}_twobatch_overlap_${link}_${n}gpu.json"
        # ORTHO=1: placement and pruning, one batch and two halves, both with the deferral (issue 53: orthogonal);
        # with OVERLAP=1 the dense sync during the backward, as session 26 measured it
        P=dedup+placement@syncfree/compile/stepgraph Q=pruned1@syncfree/compile/stepgraph
        dense=""; [ "${OVERLAP:-0}" = 1 ] && dense="--dense-sync overlap"
        [ "${ORTHO:-0}" = 1 ] && run "twobatch_${model}_${link}_ortho" 450 env $env_ $tr benchmarks/e2e.py --model $model \
          --phases train $dense \
          --variants replicated/compile/stepgraph,$P/deferwgrad,$P/twobatch/deferwgrad,$Q/deferwgrad,$Q/twobatch/deferwgrad \
          --out "$out/e2e_${model}_twobatch_ortho_${link}_${n}gpu.json"
      done
    done ;;&
  interleave|all)  # issue 53: K interleaved micro-batches in the captured prefill, one job per link
    for model in ${MODELS:-olmoe}; do
      for link in ${LINKS:-nvlink slow}; do
        env_=""; [ $link = slow ] && env_="NCCL_P2P_DISABLE=1"
        sf=dedup@syncfree/compile
        run "interleave_${model}_$link" 400 env $env_ $tr benchmarks/e2e.py --model $model --phases prefill \
          --variants replicated/compile/graph,$sf/graph,$sf/twobatch,$sf/interleave4 \
          --out "$out/e2e_${model}_interleave_${link}_${n}gpu.json"
      done
    done ;;&
  placed-slow|all)  # issue 53: placement on a trained trace's structure, slow-link prefill (fewer rows on the wire)
    sf=syncfree/compile/interleave4
    trace=${TRACE:-docs/results/fourgpu/lm_trace_e64_k8.safetensors}
    run placed_slow 400 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model olmoe --phases prefill --router-trace "$trace" \
      --variants replicated/compile/graph,dedup@$sf,dedup+placement@$sf,pruned1@$sf,pruned1@$sf/cap${PRUNED_CAP:-65} \
      --out "$out/e2e_olmoe_placed_slow_${n}gpu.json"
    # the exact placed blocks in a job of their own (a block too small for a rank's copies ends its job:
    # docs/overlap.md, "Bounded sync-free blocks": on 2 GPUs the busiest device serves up to all of T in most layers)
    run placed_slow_bounded 300 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model olmoe --phases prefill \
      --router-trace "$trace" --variants replicated/compile/graph,dedup+placement@$sf/cap${CAP:-97} \
      --out "$out/e2e_olmoe_placed_slow_bounded_${n}gpu.json" ;;&
  host-slow|all)  # issue 53: the host transport against NCCL on the slow link (docs/overlap.md, "The host transport")
    trace=${TRACE:-docs/results/fourgpu/lm_trace_e64_k8.safetensors}
    for model in ${MODELS:-olmoe qwen3}; do
      routing=""; [ $model = olmoe ] && routing="--router-trace $trace"
      run "host_${model}_prefill_slow" 300 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model $model --phases prefill \
        $routing --variants replicated/compile/graph,dedup@syncfree/compile/interleave4,dedup@host/compile/interleave2,dedup@host/compile/interleave4 \
        --out "$out/e2e_${model}_host_slow_${n}gpu.json"
      halves=compile/stepgraph/twobatch/deferwgrad
      run "host_${model}_train_slow" 300 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model $model --phases train \
        --dense-sync overlap --variants replicated/compile/stepgraph,dedup@syncfree/$halves,dedup@host/$halves,dedup@host/compile/stepgraph/deferwgrad \
        --out "$out/e2e_${model}_train_host_slow_${n}gpu.json"
      run "host_${model}_pair_slow" 450 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model $model --phases train \
        --batch 8 --accumulate 4 --dense-sync overlap \
        --variants replicated/compile/stepgraph,dedup@syncfree/compile/stepgraph/1f1b/deferwgrad,dedup@host/compile/stepgraph/1f1b/deferwgrad \
        --out "$out/e2e_${model}_pair_host_slow_${n}gpu.json"
    done ;;&
  host-profile|all)  # issue 53: where each host-transport schedule's step goes, beside its floor's
    for model in ${MODELS:-qwen3}; do
      layers=8; [ $model = olmoe ] && layers=16
      prof="$out/host_profile_$model"
      TAIL=4 run "host_profile_${model}_prefill" 300 env NCCL_P2P_DISABLE=1 $tr scripts/profile_model.py --model $model \
        --layers $layers --phases prefill --variants replicated/compile/graph,dedup@host/compile/interleave4 --traces \
        --out "$prof/prefill"
      TAIL=4 run "host_profile_${model}_train" 300 env NCCL_P2P_DISABLE=1 $tr scripts/profile_model.py --model $model \
        --layers $layers --phases train --dense-sync overlap --traces --out "$prof/train" \
        --variants replicated/compile/stepgraph,dedup@host/compile/stepgraph/twobatch/deferwgrad
      TAIL=4 run "host_profile_${model}_pair" 400 env NCCL_P2P_DISABLE=1 $tr scripts/profile_model.py --model $model \
        --layers $layers --phases train --batch 8 --accumulate 4 --dense-sync overlap --traces --out "$prof/pair" \
        --variants replicated/compile/stepgraph,dedup@host/compile/stepgraph/1f1b/deferwgrad
      for trace in "$prof"/*/trace_*_rank0.json.gz; do
        [ -f "$trace" ] && echo "$trace: $(python3 scripts/trace_exchanges.py "$trace" --steps 5 --top 0 | tail -n 1)"
      done
    done ;;&
  host-stall|all)  # issue 53: what the host halves' compute waits for under the dense all-reduce, by work queues
    for model in ${MODELS:-qwen3 olmoe}; do
      layers=8; [ $model = olmoe ] && layers=16
      for queues in 8 32; do
        prof="$out/host_stall_${model}_queues$queues"
        TAIL=4 run "host_stall_${model}_queues$queues" 200 env NCCL_P2P_DISABLE=1 CUDA_DEVICE_MAX_CONNECTIONS=$queues \
          $tr scripts/profile_model.py --model $model --layers $layers --phases train --dense-sync overlap --traces \
          --out "$prof" --variants replicated/compile/stepgraph,dedup@host/compile/stepgraph/twobatch/deferwgrad
        for trace in "$prof"/trace_*_rank0.json.gz; do
          [ -f "$trace" ] && echo "$trace:" && python3 scripts/trace_exchanges.py "$trace" --steps 5 --top 0 --stalls 1 \
            | sed -n '/^stretches/,$p'
        done
      done
    done ;;&
  pair|all)  # issue 53: accumulated micro-batches paired (combined 1F1B) against the same accumulated in turn
    for model in ${MODELS:-olmoe}; do
      for link in ${LINKS:-nvlink slow}; do
        env_=""; [ $link = slow ] && env_="NCCL_P2P_DISABLE=1"
        sf=dedup@syncfree/compile/stepgraph
        run "pair_${model}_$link" 450 env $env_ $tr benchmarks/e2e.py --model $model --phases train --batch 8 \
          --accumulate 4 --variants replicated/compile/stepgraph,$sf/deferwgrad,$sf/1f1b,$sf/1f1b/deferwgrad \
          --out "$out/e2e_${model}_pair_${link}_${n}gpu.json"
        # OVERLAP=1: the dense gradients all-reduced in buckets during the last backward (the earlier ones held)
        [ "${OVERLAP:-0}" = 1 ] && run "pair_${model}_${link}_overlap" 450 env $env_ $tr benchmarks/e2e.py --model $model \
          --phases train --batch 8 --accumulate 4 --dense-sync overlap \
          --variants replicated/compile/stepgraph,$sf/deferwgrad,$sf/1f1b/deferwgrad \
          --out "$out/e2e_${model}_pair_overlap_${link}_${n}gpu.json"
      done
    done ;;&
  grid|all)  # issue 53: persistent expert GEMMs against one program per tile (/tilegrid), side by side in one job
    sf=dedup@syncfree/compile
    for link in ${LINKS:-slow nvlink}; do
      if [ $link = nvlink ]; then
        one=$sf/stepgraph/deferwgrad
        run grid_olmoe_train_nvlink 200 $tr benchmarks/e2e.py --model olmoe --phases train \
          --variants replicated/compile/stepgraph,$one,$one/tilegrid --out "$out/e2e_olmoe_train_grid_nvlink_${n}gpu.json"
        continue
      fi
      e=NCCL_P2P_DISABLE=1
      for model in olmoe qwen3; do
        two=$sf/stepgraph/twobatch/deferwgrad
        run "grid_${model}_train_slow" 250 env $e $tr benchmarks/e2e.py --model $model --phases train --dense-sync overlap \
          --variants replicated/compile/stepgraph,$two,$two/tilegrid --out "$out/e2e_${model}_train_grid_slow_${n}gpu.json"
      done
      pair=$sf/stepgraph/1f1b/deferwgrad
      run grid_olmoe_pair_slow 300 env $e $tr benchmarks/e2e.py --model olmoe --phases train --batch 8 --accumulate 4 \
        --dense-sync overlap --variants replicated/compile/stepgraph,$pair,$pair/tilegrid \
        --out "$out/e2e_olmoe_pair_grid_slow_${n}gpu.json"
      run grid_olmoe_prefill_slow 200 env $e $tr benchmarks/e2e.py --model olmoe --phases prefill \
        --variants replicated/compile/graph,$sf/graph,$sf/interleave4,$sf/interleave4/tilegrid \
        --out "$out/e2e_olmoe_prefill_grid_slow_${n}gpu.json"
    done ;;&
  trace|all)  # issue 52: sync-free EP MoE blocks traced with their layers (/tracemoe) beside the same eager between them
    sf=dedup@syncfree
    run trace_suite 200 env OCCULT_GPU_SUITE_STAGES=1 PYTEST_ARGS="-k 'traced_sync_free or compiled_exchange'" bash tests/gpu/run.sh "$out/trace_suite"
    for model in olmoe qwen3; do
      run "trace_${model}_train" 200 $tr benchmarks/e2e.py --model $model --phases train \
        --variants replicated/compile/stepgraph,$sf/compile/stepgraph,$sf/compile/stepgraph/deferwgrad,$sf/tracemoe/compile/stepgraph \
        --out "$out/e2e_${model}_train_traced_nvlink_${n}gpu.json"
    done
    run trace_olmoe_prefill 150 $tr benchmarks/e2e.py --model olmoe --phases prefill \
      --variants replicated/compile/graph,$sf/compile/graph,$sf/tracemoe/compile/graph \
      --out "$out/e2e_olmoe_prefill_traced_nvlink_${n}gpu.json"
    ;;&
  titan|titan-slow|titan-slow-compiled|all)  # issue 52: TorchTitan with occult's dispatcher sync-free, like with like
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    tt=torchtitan+occult+experts
    # occult's fastest train step per link (--dense-sync reaches occult's own model only, not TorchTitan's)
    case $part in
      titan-slow) name=slow; e=NCCL_P2P_DISABLE=1; dense="--dense-sync overlap"
        variants=torchtitan,$tt@syncfree,dedup@syncfree/compile/stepgraph/twobatch/deferwgrad ;;
      titan-slow-compiled) name=compiled_slow; e=NCCL_P2P_DISABLE=1; dense=
        variants=torchtitan/compile,$tt@syncfree/compile,$tt@syncfree/compile/stepgraph ;;
      *) name=nvlink; e=; dense=
        variants=torchtitan,$tt@syncfree,dedup@syncfree/compile/stepgraph/deferwgrad,$tt@syncfree/compile,torchtitan/compile,$tt@syncfree/stepgraph,$tt@syncfree/compile/stepgraph ;;
    esac
    run "titan_$name" 570 env $e $tr benchmarks/e2e.py --model qwen3 --phases train $dense --variants $variants \
      --out "$out/e2e_qwen3_titan_syncfree_${name}_${n}gpu.json" ;;&
  titan-profile|all)
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    tt=torchtitan+occult+experts
    TAIL=30 run titan_profile 540 $tr scripts/profile_model.py --model qwen3 --layers 8 --phases train --steps 3 \
      --variants torchtitan/compile,$tt@syncfree/compile/stepgraph,dedup@syncfree/compile/stepgraph/deferwgrad \
      --traces --out "$out/titan_profile" ;;&
  peer|all)
    if [ -d .whl ] && [ "${DRY_RUN:-0}" != 1 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    run peer_nvlink 280 $tr benchmarks/e2e.py --model qwen3 --variants replicated,standard,dedup,torchtitan \
      --out "$out/e2e_qwen3_${n}gpu_peer.json"
    run peer_slow 280 env NCCL_P2P_DISABLE=1 $tr benchmarks/e2e.py --model qwen3 --variants replicated,standard,dedup,torchtitan \
      --out "$out/e2e_qwen3_${n}gpu_peer_nop2p.json" ;;&
  train|train-slow|all)
    data=$(train_corpus) || exit 2
    lm="--corpus-dir $data --hidden 1024 --layers 4 --heads 16 --experts 64 --top-k 8 --expert-ffn 512 --seq-len 1024
        --batch-size $((8 * n)) --steps 40 --eval-every 20 --eval-tokens 16384 --save-every 0 --no-progress"
    links="nvlink slow"; [ "$part" = train ] && links=nvlink; [ "$part" = train-slow ] && links=slow
    for link in $links; do
      env_=""; [ $link = slow ] && env_="NCCL_P2P_DISABLE=1"
      for v in floor standard dedup; do
        flags="--dispatcher $v"; [ $v = floor ] && flags="--ep-size 1"
        run "train_${link}_$v" 140 env $env_ $tr -m occult train $lm $flags --out "/tmp/occult_train_${link}_$v"
        [ "${DRY_RUN:-0}" = 1 ] || python3 -c "import json,sys; m=[json.loads(l) for l in open(sys.argv[1])][-1]; \
json.dump(dict(m, link=sys.argv[2], variant=sys.argv[3], gpus=$n), open(sys.argv[4], 'w'))" \
          "/tmp/occult_train_${link}_$v/metrics.jsonl" $link $v "$out/train_${n}gpu_${link}_$v.json"
      done
    done ;;&
  serve|serve-slow|all)  # issue 37: EP decode against transformers' compiled generate and the replicated floor
    links="nvlink slow"; [ "$part" = serve ] && links=nvlink; [ "$part" = serve-slow ] && links=slow
    for link in $links; do
      env_=""; [ $link = slow ] && env_="NCCL_P2P_DISABLE=1"
      # issue 37's three in the order they run (the floor, occult EP: "auto" = the device transport on NVLink,
      # the sync-free count exchange with NCCL_P2P_DISABLE; then transformers' compiled generate, the slowest: a job
      # cut by its bound keeps the floor and EP); SERVE_VARIANTS, SERVE_BATCH to choose others
      serve_variants=${SERVE_VARIANTS:-replicated+compile+graph,generate+compile+graph,native-generate+compile}
      for model in ${MODELS:-olmoe qwen3}; do  # ~40-70 s a (variant, B) on 2 x H200: a 10-min call holds ~8
        run "serve_${model}_$link" "${SERVE_TIMEOUT_S:-540}" env $env_ $tr benchmarks/serve.py --model $model --batch "${SERVE_BATCH:-1,8,64,256}" \
          --prompt-len 128 --new-tokens 32 --repeats 3 \
          --variants "$serve_variants" \
          --out "$out/serve_${model}_${link}_${n}gpu.json"
      done
    done
    [ "${DRY_RUN:-0}" = 1 ] || python3 benchmarks/serve_plot.py "$out"/serve_*_"${n}"gpu.json --plot "$out/serve_${n}gpu.png" \
      --md "$out/serve_${n}gpu.md" ;;&
  probe|all)
    run find_syncs 120 python3 scripts/find_syncs.py
    run bench_layer 200 python3 -m occult.cli bench --world-size "$n" --shapes olmoe,qwen3,deepseek --tokens 8192 \
      --out "$out/bench_${n}gpu.json" ;;&
  scale|all)
    run migrate_time 200 $tr benchmarks/migrate_time.py --backend nccl --experts 64 --top-k 8 \
      --hidden 2048 --ffn 1024 --layers 16 --out "$out/migrate_${n}gpu.json"
    if [ "$n" -ge 4 ]; then
      run bench_dedup2 300 python3 -m occult.cli bench --world-size "$n" --shapes olmoe --variants standard,dedup,dedup2 \
        --nodes 2 --out "$out/bench_dedup2_${n}gpu.json"
    fi ;;
esac
# what the runs so far say about the issues' targets (scripts/targets_report.py; also $out/targets.md)
[ "${DRY_RUN:-0}" = 1 ] || python3 scripts/targets_report.py "$out" --md "$out/targets.md"
