#!/usr/bin/env bash
# The peers' wheels for the GPU machine (Python 3.12, x86-64; it has no network), into .whl/ (git-ignored: a new
# checkout starts without it). Run from the repo root on a machine with network, then carry .whl:
#
#   bash scripts/fetch_peer_wheels.sh            # TorchTitan 0.3.0 and what it imports (e2e.py torchtitan*)
#   bash scripts/fetch_peer_wheels.sh megatron   # also Megatron-Core 0.19.2 (the GPU suite's Megatron cases: tests/gpu/run.sh
#                                                # installs only this wheel of .whl for them)
#   bash scripts/fetch_peer_wheels.sh all        # also Megatron-Core 0.19.2, transformers 5.23, DeepSpeed (peers/run.py)
#
# On the GPU machine: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=.:/tmp/site
# (scripts/one_gpu_runs.sh and multi_gpu_runs.sh do it where .whl exists). docs/benchmarks.md, "Reproduce".
set -euo pipefail
which=${1:-torchtitan}
case $which in torchtitan|megatron|all) ;; *) echo "fetch_peer_wheels.sh: give torchtitan, megatron or all, not '$which'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q "${P[@]}" -d .whl torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 \
  typeguard==4.6.0
if [ "$which" = megatron ]; then
  python3 -m pip download -q "${P[@]}" -d .whl megatron-core==0.19.2
fi
if [ "$which" = all ]; then
  python3 -m pip download -q "${P[@]}" -d .whl megatron-core==0.19.2 transformers==5.23.0 regex==2026.1.15 \
    pydantic==2.13.4 pydantic_core==2.46.4 annotated-types typing-inspection typing_extensions hjson
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" deepspeed==0.19.8  # an sdist only on PyPI
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$tmp"/deepspeed-0.19.8.tar.gz
  rm -rf "$tmp"
fi
ls .whl
