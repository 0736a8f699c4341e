"""Can a copy-engine copy (cuMemcpyBatchAsync, prefer-overlap hint) be captured in a CUDA graph,
and does it then overlap a matmul that holds every SM? (issue 14; NOTES item 9's open question)

    python bench/diag_capture_copies.py [--mb 512] [--chunks 8] [--reps 20]

The fused all-gather-matmul's chunk copies ask for a copy engine in eager; under capture they
are plain copies and the consumer leaves SMs free for them (fused._consumer_sms), because the
batch API was never tried under capture. This measures, on one GPU, with cuda events (median of
--reps): a bf16 matmul alone; the copies alone (batch and plain, eager and replayed from a
graph); and both on two streams at once, eager and from one graph that forks the two streams.
Overlap = (matmul + copies - both) / copies: 1 where the copies hide entirely beside the
matmul, 0 where they serialize. Also checks that the replayed copies moved fresh data.
"""

import argparse
import ctypes
import statistics

import torch


class _Attr(ctypes.Structure):  # CUmemcpyAttributes (CUDA 13)
    _fields_ = [("order", ctypes.c_int), ("src_type", ctypes.c_int), ("src_id", ctypes.c_int),
                ("dst_type", ctypes.c_int), ("dst_id", ctypes.c_int), ("flags", ctypes.c_uint)]  # fmt: skip


def _batch_fn():
    lib = ctypes.CDLL("libcuda.so.1")
    fn, status = ctypes.c_void_p(), ctypes.c_int()
    rc = lib.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(fn), 13000, ctypes.c_uint64(0),
                                 ctypes.byref(status))  # fmt: skip
    if rc != 0 or not fn.value:
        raise SystemExit(f"cuMemcpyBatchAsync not resolved (rc {rc}, status {status.value})")
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                             ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(_Attr),
                             ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.c_void_p)  # fmt: skip
    return proto(fn.value)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=512, help="bytes copied per pass, in MiB")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    batch = _batch_fn()
    dev = torch.cuda.current_device()
    n = a.mb * 2**20
    src, dst = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    X = torch.randn(8192, 8192, device="cuda").bfloat16()
    Y = torch.randn(8192, 8192, device="cuda").bfloat16()
    step = n // a.chunks
    attr = _Attr(1, 1, dev, 1, dev, 1)
    rcs = []

    def copies_batch(s):
        for i in range(a.chunks):
            d = (ctypes.c_uint64 * 1)(dst.data_ptr() + i * step)
            sp = (ctypes.c_uint64 * 1)(src.data_ptr() + i * step)
            sz, idx = (ctypes.c_size_t * 1)(step), (ctypes.c_size_t * 1)(0)
            rcs.append(batch(d, sp, sz, 1, ctypes.byref(attr), idx, 1, ctypes.c_void_p(s.cuda_stream)))

    def copies_plain(s):
        with torch.cuda.stream(s):
            for i in range(a.chunks):
                dst[i * step:(i + 1) * step].copy_(src[i * step:(i + 1) * step])

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        ts = []
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        for _ in range(a.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3)
        return statistics.median(ts)

    def both(copy):
        def run():  # (the current stream: the capture's, under capture)
            cur = torch.cuda.current_stream()
            s1.wait_stream(cur)
            s2.wait_stream(cur)
            with torch.cuda.stream(s2):
                torch.mm(X, Y)
            copy(s1)
            cur.wait_stream(s1)
            cur.wait_stream(s2)

        return run

    def alone(copy):
        def run():  # on a side stream: the batch API refuses the legacy default stream
            cur = torch.cuda.current_stream()
            s1.wait_stream(cur)
            copy(s1)
            cur.wait_stream(s1)

        return run

    def graph_of(fn):
        g = torch.cuda.CUDAGraph()
        cap = torch.cuda.Stream()
        cap.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        with torch.cuda.stream(cap):
            torch.mm(X, Y)  # warm cuBLAS's workspace on the capture stream
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(g, stream=cap):
                fn()
        except Exception as e:  # noqa: BLE001
            return None, f"{type(e).__name__}: {e}"
        return g, None

    res = {}
    res["mm"] = timed(lambda: torch.mm(X, Y))
    res["copies batch, eager"] = timed(alone(copies_batch))
    print("batch return codes, eager alone (0: CUDA_SUCCESS):", sorted(set(rcs)))
    rcs.clear()
    res["copies plain, eager"] = timed(alone(copies_plain))
    res["mm + batch, eager"] = timed(both(copies_batch))
    print("batch return codes, eager beside the matmul:", sorted(set(rcs)))
    res["mm + plain, eager"] = timed(both(copies_plain))
    for kind, copy in (("batch", copies_batch), ("plain", copies_plain)):
        rcs.clear()
        g, err = graph_of(alone(copy))
        print(f"capture of {kind} copies:", "ok" if g is not None else err, "rcs", sorted(set(rcs)))
        if g is None or any(rcs):  # (a refused call leaves the capture empty, or invalid)
            continue
        src.random_(0, 255)
        dst.zero_()
        g.replay()
        torch.cuda.synchronize()
        print(f"  replayed {kind} copies moved fresh data:", bool(torch.equal(src, dst)))
        res[f"copies {kind}, graph"] = timed(g.replay)
        rcs.clear()
        g2, err = graph_of(both(copy))
        print(f"capture of mm + {kind} copies (two streams):", "ok" if g2 is not None else err, "rcs", sorted(set(rcs)))
        if g2 is not None:
            res[f"mm + {kind}, graph"] = timed(g2.replay)
    mm = res["mm"]
    for k, v in res.items():
        line = f"{k:28s} {v:9.1f} us"
        if k.startswith("mm + "):
            kind, mode = k[5:].split(", ")
            c = res.get(f"copies {kind}, {mode}")
            if c:
                line += f"   overlap {(mm + c - v) / c:5.2f}  (vs max {max(mm, c):.1f})"
        print(line)
    gb = n / 1e9
    for k in ("copies batch, eager", "copies plain, eager", "copies batch, graph", "copies plain, graph"):
        if k in res:
            print(f"{k:28s} {2 * gb / (res[k] * 1e-6) / 1e3:6.2f} TB/s (read + write)")


if __name__ == "__main__":
    main()
