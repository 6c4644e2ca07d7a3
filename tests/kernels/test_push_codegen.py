"""The device transport's store kernels compile to 16-byte stores into the peers' rows (Hopper PTX).

`pack_push_rows` and `push_rows` store through addresses loaded from memory (each peer's receive
rows), whose alignment Triton cannot see: without a hint they compiled to one 2-byte store per bf16
element (dispatch) and 4-byte stores (combine). `symm.DeviceTransport` checks that every receive
buffer starts 16-byte aligned, and the kernels say so (`tl.multiple_of`). This compiles both kernels
for sm_90 on the CPU (Triton's NVIDIA backend ships with its wheel; no GPU needed) in a process
without the interpreter, and reads the PTX: vector stores for the rows, and, with a row width Triton
cannot prove 16-byte divisible, the scalar stores that stay correct there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _stores(fn, signature: dict, constexprs: dict, aligned_args: tuple[int, ...]) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned_args}  # as a launch specialises 16-divisible args
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return sorted(set(re.findall(r"st\.global\.[a-z0-9.]+", ptx)))


def _compile_both() -> dict[str, list[str]]:
    from occult.kernels import pack, push

    pack_sig = {
        "x_ptr": "*bf16",
        "token_ptr": "*i64",
        "w_ptr": "*fp32",
        "entry_ptr": "*i64",
        "slot_ptr": "*i32",
        "counts_ptr": "*i64",
        "status_ptr": "*i64",
        "peer_rows_ptr": "*i64",
        "peer_counts_ptr": "*i64",
        "K": "i32",
        "x_stride": "i32",
        "rank": "i32",
        "stride_rows": "i32",
        "row_bytes": "i32",
        "gate_byte": "i32",
        "slot_byte": "i32",
        "D": "i32",
        "status_slot": "i32",
        "H": "constexpr",
        "BLOCK_H": "constexpr",
        "K_POW2": "constexpr",
        "D_POW2": "constexpr",
        "HAS_STATUS": "constexpr",
    }
    pack_const = {"H": 2048, "BLOCK_H": 1024, "K_POW2": 8, "D_POW2": 2, "HAS_STATUS": True}
    pointers = tuple(range(9))
    push_sig = {
        "src_ptr": "*i32",
        "counts_ptr": "*i64",
        "status_ptr": "*i64",
        "peer_rows_ptr": "*i64",
        "peer_counts_ptr": "*i64",
        "rank": "i32",
        "stride_rows": "i32",
        "src_stride": "i32",
        "D": "i32",
        "status_slot": "i32",
        "W": "constexpr",
        "BLOCK_R": "constexpr",
        "BLOCK_W": "constexpr",
        "NUM_BLOCKS": "constexpr",
        "PACKED": "constexpr",
        "D_POW2": "constexpr",
        "HAS_STATUS": "constexpr",
    }
    push_const = {"BLOCK_R": 4, "BLOCK_W": 1024, "NUM_BLOCKS": 64, "PACKED": False, "D_POW2": 2, "HAS_STATUS": False}
    return {
        # x_stride, stride_rows, row_bytes divisible by 16 (rows of whole 64-byte lines)
        "pack": _stores(pack._pack_push_kernel, pack_sig, pack_const, pointers + (10, 12, 13)),
        "pack_odd_row_bytes": _stores(pack._pack_push_kernel, pack_sig, pack_const, pointers + (10, 12)),
        "push": _stores(push._push_kernel, push_sig, dict(push_const, W=1040), tuple(range(5)) + (6, 7)),
        "push_odd_width": _stores(push._push_kernel, push_sig, dict(push_const, W=1041), tuple(range(5)) + (6, 7)),
    }


def test_rows_go_to_the_peers_in_16_byte_stores():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if res.returncode == 3:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stderr[-3000:]
    stores = json.loads(res.stdout.strip().splitlines()[-1])
    # the rows: 16-byte vectors; the small scalars (counts, gates, slots) stay 4/8-byte stores
    assert "st.global.v4.b32" in stores["pack"] and "st.global.b16" not in stores["pack"], stores
    assert "st.global.v4.b32" in stores["push"] and "st.global.b32" not in stores["push"], stores
    # a row width Triton cannot prove 16-byte divisible keeps narrower stores (correct either way)
    assert "st.global.b16" in stores["pack_odd_row_bytes"], stores
    assert "st.global.v4.b32" not in stores["push_odd_width"], stores


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:
        print(f"Triton's NVIDIA backend is not installed ({exc})")
        sys.exit(3)
    print(json.dumps(_compile_both()))
