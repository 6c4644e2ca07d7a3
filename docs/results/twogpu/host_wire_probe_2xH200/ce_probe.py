"""Probe: an all-to-all of fixed blocks through shared pinned host memory, moved by copy engines.

Each ordered pair (src, dst) owns a ring of S slots x C bytes in one POSIX shared-memory file that every rank
registers with CUDA (cuMemHostRegister, portable + mapped) and one uint32 flag per slot (0 free, 1 full).
The sender's stream (one per peer): wait flag == 0, copy device -> slot, write flag = 1; the receiver's stream
(one per peer): wait flag == 1, copy slot -> device, write flag = 0. Stream memory operations
(cuStreamWaitValue32 / cuStreamWriteValue32) do the hand-off on the GPUs: no host in the loop, capturable.
Compared in the same job with NCCL's all_to_all_single (run under NCCL_P2P_DISABLE=1), alone and beside a GEMM.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import statistics

import torch
import torch.distributed as dist

cu = ctypes.CDLL("libcuda.so.1")
for name, args in {
    "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [ctypes.c_void_p],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint],
    "cuStreamWaitValue32_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint],
    "cuStreamWriteValue32_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint],
    "cuMemcpyAsync": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
}.items():
    getattr(cu, name).argtypes = args
    getattr(cu, name).restype = ctypes.c_int

WAIT_EQ = 1


def check(res: int, what: str) -> None:
    if res != 0:
        s = ctypes.c_char_p()
        cu.cuGetErrorName(res, ctypes.byref(s))
        raise RuntimeError(f"{what} failed: {s.value}")


FLAG_STRIDE = 64


class HostRing:
    def __init__(self, path: str, world: int, rank: int, slots: int, chunk: int, create: bool) -> None:
        self.world, self.rank, self.slots, self.chunk = world, rank, slots, chunk
        pairs = world * world
        self.flag_bytes = -(-(pairs * slots * FLAG_STRIDE) // 4096) * 4096
        self.nbytes = self.flag_bytes + pairs * slots * chunk
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        if create:
            os.ftruncate(fd, self.nbytes)
        self.mm = mmap.mmap(fd, self.nbytes)
        os.close(fd)
        self.host = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        if create:
            ctypes.memset(self.host, 0, self.flag_bytes)
        check(cu.cuMemHostRegister_v2(ctypes.c_void_p(self.host), self.nbytes, 1 | 2), "cuMemHostRegister")
        dptr = ctypes.c_uint64()
        check(cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(self.host), 0), "getdevptr")
        self.dev = dptr.value
        torch.cuda.current_device()
        self.send_streams = {p: torch.cuda.Stream() for p in range(world) if p != rank}
        self.recv_streams = {p: torch.cuda.Stream() for p in range(world) if p != rank}

    def flag(self, src: int, dst: int, slot: int) -> int:
        return self.dev + ((src * self.world + dst) * self.slots + slot) * FLAG_STRIDE

    def slot(self, src: int, dst: int, slot: int) -> int:
        return self.dev + self.flag_bytes + ((src * self.world + dst) * self.slots + slot) * self.chunk

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """send, recv: [world, B] uint8 on this GPU; block p of send goes to rank p's block `rank` of recv."""
        main = torch.cuda.current_stream()
        ready = torch.cuda.Event()
        ready.record(main)
        B = send.shape[1]
        n_chunks = -(-B // self.chunk)
        done = []
        for p, st in self.send_streams.items():
            st.wait_event(ready)
            h = ctypes.c_void_p(st.cuda_stream)
            src = send[p].data_ptr()
            for i in range(n_chunks):
                s = i % self.slots
                n = min(self.chunk, B - i * self.chunk)
                check(cu.cuStreamWaitValue32_v2(h, self.flag(self.rank, p, s), 0, WAIT_EQ), "wait0")
                check(cu.cuMemcpyAsync(self.slot(self.rank, p, s), src + i * self.chunk, n, h), "d2h")
                check(cu.cuStreamWriteValue32_v2(h, self.flag(self.rank, p, s), 1, 0), "write1")
            e = torch.cuda.Event()
            e.record(st)
            done.append(e)
        for p, st in self.recv_streams.items():
            st.wait_event(ready)
            h = ctypes.c_void_p(st.cuda_stream)
            dst = recv[p].data_ptr()
            for i in range(n_chunks):
                s = i % self.slots
                n = min(self.chunk, B - i * self.chunk)
                check(cu.cuStreamWaitValue32_v2(h, self.flag(p, self.rank, s), 1, WAIT_EQ), "wait1")
                check(cu.cuMemcpyAsync(dst + i * self.chunk, self.slot(p, self.rank, s), n, h), "h2d")
                check(cu.cuStreamWriteValue32_v2(h, self.flag(p, self.rank, s), 0, 0), "write0")
            e = torch.cuda.Event()
            e.record(st)
            done.append(e)
        recv[self.rank].copy_(send[self.rank])
        for e in done:
            main.wait_event(e)


def cuda_ms(fn, iters: int, fresh=None) -> float:
    times = []
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for _ in range(iters):
        if fresh is not None:
            fresh()
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    torch.empty(1, device="cuda")
    attr = ctypes.c_int()
    cu.cuDeviceGetAttribute(ctypes.byref(attr), 91, rank)  # CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
    out: dict = {"host_pointer_for_registered": attr.value, "rows": []}
    path = f"/dev/shm/occult_ce_probe_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}"
    results = {}
    for slots, chunk_mib in [(4, 1), (4, 2), (8, 1), (2, 4)]:
        chunk = chunk_mib << 20
        if rank == 0:
            ring = HostRing(path, world, rank, slots, chunk, create=True)
        dist.barrier()
        if rank != 0:
            ring = HostRing(path, world, rank, slots, chunk, create=False)
        dist.barrier()
        for mib in (2, 8, 32):
            B = mib << 20
            send = torch.empty(world, B, dtype=torch.uint8, device="cuda")
            recv = torch.empty_like(send)

            def fresh():
                send.random_(0, 256)

            # correctness: each block tagged by (src, dst)
            for _trial in range(3):
                fresh()
                g = [torch.empty_like(send) for _ in range(world)]
                dist.all_gather(g, send)
                ring.exchange(send, recv)
                torch.cuda.synchronize()
                for p in range(world):
                    assert torch.equal(recv[p], g[p][rank]), f"mismatch slots={slots} chunk={chunk_mib} mib={mib} p={p}"
            ce = cuda_ms(lambda: ring.exchange(send, recv), 15, fresh)
            nccl_out = torch.empty_like(send)
            nc = cuda_ms(lambda: dist.all_to_all_single(nccl_out.view(-1), send.view(-1)), 15, fresh)
            key = f"S{slots}_C{chunk_mib}MiB_{mib}MiB"
            results[key] = {
                "ce_ms": ce,
                "nccl_ms": nc,
                "ce_GBps": B * (world - 1) / ce / 1e6,
                "nccl_GBps": B * (world - 1) / nc / 1e6,
            }
            if rank == 0:
                print(key, {k: round(v, 3) for k, v in results[key].items()}, flush=True)
        # overlap with a GEMM and graph capture at 32 MiB
        B = 32 << 20
        send = torch.randint(0, 256, (world, B), dtype=torch.uint8, device="cuda")
        recv = torch.empty_like(send)
        nccl_out = torch.empty_like(send)
        a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()

        def gemm():
            for _ in range(4):
                a @ w

        def with_ce():
            ev = torch.cuda.Event()
            ev.record()
            with torch.cuda.stream(side):
                side.wait_event(ev)
                ring.exchange(send, recv)
            gemm()
            torch.cuda.current_stream().wait_stream(side)

        def with_nccl():
            ev = torch.cuda.Event()
            ev.record()
            with torch.cuda.stream(side):
                side.wait_event(ev)
                dist.all_to_all_single(nccl_out.view(-1), send.view(-1))
            gemm()
            torch.cuda.current_stream().wait_stream(side)

        ov = {
            "gemm_ms": cuda_ms(gemm, 15),
            "ce_ms": cuda_ms(lambda: ring.exchange(send, recv), 15),
            "nccl_ms": cuda_ms(lambda: dist.all_to_all_single(nccl_out.view(-1), send.view(-1)), 15),
            "gemm_with_ce_ms": cuda_ms(with_ce, 15),
            "gemm_with_nccl_ms": cuda_ms(with_nccl, 15),
        }
        # graph capture of the exchange
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            torch.cuda.synchronize()
            dist.barrier()
            with torch.cuda.graph(g, stream=s):
                ring.exchange(send, recv)
            torch.cuda.synchronize()
            dist.barrier()
            ok = True
            for _trial in range(3):
                send.random_(0, 256)
                gl = [torch.empty_like(send) for _ in range(world)]
                dist.all_gather(gl, send)
                torch.cuda.synchronize()
                dist.barrier()
                g.replay()
                torch.cuda.synchronize()
                ok &= all(torch.equal(recv[p], gl[p][rank]) for p in range(world))
            ov["graph_ok"] = ok
            ov["graph_ms"] = cuda_ms(g.replay, 15)
            # eager after replays still consistent
            send.random_(0, 256)
            gl = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(gl, send)
            ring.exchange(send, recv)
            torch.cuda.synchronize()
            ov["eager_after_graph_ok"] = all(torch.equal(recv[p], gl[p][rank]) for p in range(world))
        except Exception as exc:  # noqa: BLE001
            ov["graph_error"] = repr(exc)[:400]
            torch.cuda.synchronize()
        results[f"S{slots}_C{chunk_mib}MiB_overlap32"] = ov
        if rank == 0:
            print(
                f"S{slots}_C{chunk_mib} overlap",
                {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ov.items()},
                flush=True,
            )
        dist.barrier()
        torch.cuda.synchronize()
        check(cu.cuMemHostUnregister(ctypes.c_void_p(ring.host)), "unregister")
        dist.barrier()
        if rank == 0:
            os.unlink(path)
    out["results"] = results
    if rank == 0:
        with open(os.path.join(os.environ["OUT"], "ce_probe.json"), "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
