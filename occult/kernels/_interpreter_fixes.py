"""Work-around for a bug of Triton 3.6's CPU interpreter (`TRITON_INTERPRET=1` only).

With numpy >= 2.4 a loop bound that is a tensor (`range(start, end, step)` with loaded or
argument values) fails: the interpreter's `__index__` calls `int()` on a 1-element 1-d array,
which numpy 2.4 refuses (triton-lang/triton#9171, fixed upstream by #9172 after 3.6).
`apply()` patches the interpreter in place, once; it is a no-op when Triton's internals differ
from what it expects. Compiled (GPU) kernels are untouched.

(A second interpreter bug, `tl.dot` on bfloat16 operands multiplying the raw uint16 bit
patterns, is avoided in the kernels themselves: under the interpreter they upcast dot operands
to fp32, which is exact, see `UPCAST`.)
"""

from __future__ import annotations

import numpy as np

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover
        return

    patch_tensor = getattr(interp, "_patch_lang_tensor", None)
    if patch_tensor is not None:

        def _patch_lang_tensor(tensor, scope, _orig=patch_tensor):
            _orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        interp._patch_lang_tensor = _patch_lang_tensor
