"""Experiment only (session 41): benchmarks/e2e.py with the host transport cutting a pair's bytes into CHUNKS chunks."""

import os
import runpy
import sys

import occult.moe.host_wire as host_wire

host_wire.SLOTS = int(os.environ["CHUNKS"])  # chunk_sizes' target (the ring keeps its 4 slots: bound at import)
sys.path.insert(0, "benchmarks")
sys.argv[0] = "benchmarks/e2e.py"
runpy.run_path("benchmarks/e2e.py", run_name="__main__")
