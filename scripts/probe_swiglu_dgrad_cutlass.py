"""Probe (session 49, removed after): the CUTLASS fused SwiGLU dgrad (occult/kernels/csrc/swiglu_dgrad_sm90.cu) against
_grouped_mm + the Triton pass at the OLMoE layer shape on one GPU: errors against an fp32 truth, graph capture, CUDA-event
medians eager and replayed. Usage: python3 probe_swiglu_dgrad_cutlass.py LIB.so [OUT.json]"""

import ctypes, json, os, statistics, sys
import torch
from occult.kernels.grouped_mm import swiglu_dgrad_grouped

LIB = sys.argv[1]
OUT = sys.argv[2] if len(sys.argv) > 2 else None
lib = ctypes.CDLL(LIB)
dev = torch.cuda.current_device()
sms = torch.cuda.get_device_properties(dev).multi_processor_count
P_, E, H, F = 65536, 64, 2048, 1024


def sizes(E, F):
    gb, wb = ctypes.c_longlong(), ctypes.c_longlong()
    lib.occult_swiglu_dgrad_sizes(E, F, sms, dev, ctypes.byref(gb), ctypes.byref(wb))
    return gb.value, wb.value


def fused(dy, pair, offsets, down, ab, gates, bufs=None):
    E = down.shape[0]
    F = down.shape[2]
    H = down.shape[1]
    bound = pair.numel()
    gb, wb = sizes(E, F)
    if bufs is None:
        bufs = (
            torch.empty(gb, dtype=torch.uint8, device=dy.device),
            torch.empty(max(wb, 1), dtype=torch.uint8, device=dy.device),
            torch.empty(bound, dtype=torch.float32, device=dy.device),
            torch.empty(bound, dtype=torch.float32, device=dy.device),
        )
    grp, ws, gs, dgs = bufs
    dab = ab.new_empty((bound, 2 * F))
    dg = torch.zeros(bound, dtype=torch.float32, device=dy.device)
    rc = lib.occult_swiglu_dgrad_run(
        ctypes.c_void_p(dy.data_ptr()),
        ctypes.c_void_p(down.data_ptr()),
        ctypes.c_void_p(ab.data_ptr()),
        ctypes.c_void_p(gates.data_ptr()),
        ctypes.c_void_p(pair.data_ptr()),
        ctypes.c_void_p(offsets.data_ptr()),
        ctypes.c_void_p(dab.data_ptr()),
        ctypes.c_void_p(dg.data_ptr()),
        ctypes.c_void_p(gs.data_ptr()),
        ctypes.c_void_p(dgs.data_ptr()),
        ctypes.c_void_p(grp.data_ptr()),
        ctypes.c_void_p(ws.data_ptr()),
        E,
        bound,
        F,
        H,
        sms,
        dev,
        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
    )
    assert rc == 0, f"rc={rc}"
    return dab, dg


def inputs(P, extra, E, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.multinomial(torch.ones(E, device="cuda"), P, replacement=True, generator=g).bincount(minlength=E)
    counts[3] += counts[5]
    counts[5] = 0  # an expert with no rows
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = counts.cumsum(0)
    bound = P + extra
    pair = torch.randperm(bound, device="cuda", generator=g).int()
    gates = torch.rand(bound, device="cuda", generator=g) + 0.05
    dy = torch.randn(bound, H, device="cuda", dtype=torch.bfloat16, generator=g)
    down = (torch.randn(E, H, F, device="cuda", generator=g) * 0.02).bfloat16()
    ab = torch.randn(bound, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g)
    return dy, pair, offsets, down, ab, gates


def truth(dy, pair, offsets, down, ab, gates):
    P = int(offsets[-1])
    dab = torch.zeros(P, 2 * F, device="cuda")
    dg = torch.zeros(pair.numel(), device="cuda")
    for e in range(down.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi == lo:
            continue
        u = dy[lo:hi].float() @ down[e].float()
        a, b = ab[lo:hi, :F].float(), ab[lo:hi, F:].float()
        g = gates[pair[lo:hi].long()][:, None]
        s = torch.sigmoid(a)
        silu = a * s
        dab[lo:hi, :F] = g * u * b * (s + silu * (1 - s))
        dab[lo:hi, F:] = g * u * silu
        dg[pair[lo:hi].long()] = (u * silu * b).sum(1)
    return dab, dg


def err(x, ref):
    return float((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


res = {"gpu": torch.cuda.get_device_name(), "lib": os.path.basename(LIB)}
for name, (P, extra) in {"olmoe": (P_, 0), "trailing": (4096, 300)}.items():
    args = inputs(P, extra, E, 1)
    dab_t, dg_t = truth(*args)
    dab_f, dg_f = fused(*args)
    dab_r, dg_r = swiglu_dgrad_grouped(*args)
    torch.cuda.synchronize()
    Pn = int(args[2][-1])
    res[name] = {
        "fused_dab_err": err(dab_f[:Pn], dab_t),
        "ref_dab_err": err(dab_r[:Pn], dab_t),
        "fused_dg_err": err(dg_f, dg_t),
        "ref_dg_err": err(dg_r, dg_t),
    }
    print(name, res[name], flush=True)

# graph capture
args = inputs(P_, 0, E, 2)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    fused(*args)
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
gr = torch.cuda.CUDAGraph()
with torch.cuda.graph(gr):
    out = fused(*args)
new = inputs(P_, 0, E, 3)
for dst, src in zip(args, new):
    dst.copy_(src)
gr.replay()
torch.cuda.synchronize()
dab_t, dg_t = truth(*args)
res["graph"] = {"dab_err": err(out[0], dab_t), "dg_err": err(out[1], dg_t)}
print("graph", res["graph"], flush=True)


def timed(fn, iters=30):
    ts = []
    for _ in range(5):
        fn()
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


args = inputs(P_, 0, E, 4)
dy, pair, offsets, down, ab, gates = args
res["ms"] = {
    "grouped_mm_u_only": timed(lambda: torch._grouped_mm(dy, down, offs=offsets[1:])),
    "grouped_mm_plus_pass": timed(lambda: swiglu_dgrad_grouped(*args)),
    "fused_cutlass": timed(lambda: fused(*args)),
}
for _ in range(2):
    res["ms"]["grouped_mm_plus_pass_again"] = timed(lambda: swiglu_dgrad_grouped(*args))
    res["ms"]["fused_cutlass_again"] = timed(lambda: fused(*args))
print(json.dumps(res, indent=1))
if OUT:
    json.dump(res, open(OUT, "w"), indent=1)


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


res["graph_ms"] = {}
for _ in range(2):
    res["graph_ms"]["grouped_mm_plus_pass"] = timed(graphed(lambda: swiglu_dgrad_grouped(*args)))
    res["graph_ms"]["fused_cutlass"] = timed(graphed(lambda: fused(*args)))
    res["graph_ms"]["grouped_mm_u_only"] = timed(graphed(lambda: torch._grouped_mm(dy, down, offs=offsets[1:])))
print(json.dumps(res["graph_ms"], indent=1))
if OUT:
    json.dump(res, open(OUT, "w"), indent=1)
