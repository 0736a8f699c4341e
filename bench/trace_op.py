"""GPU timeline of one call of a torch.ops.mptp op on a loopback group (where the time goes).

    python bench/trace_op.py --op ag --N 7168 --K 8192 [--kind bf16|fp8_row] [--M 8192] [--W 8]

Runs the op a few times, then profiles two calls (torch.profiler, CUDA activity) and
prints every kernel, copy and memset of the last call in start order, with its stream,
offset from the call's first GPU event and duration, then the profiler's summary table.
Writes the Chrome trace to $OUT/trace_<op>.json when OUT is set.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_all_gather_matmul import _inputs, _shard, op_call  # noqa: E402
from bench_matmul_reduce_scatter import _inputs as rs_inputs  # noqa: E402
from bench_matmul_reduce_scatter import op_call as rs_op_call  # noqa: E402

from mptp_kernels.symm.loopback import init_loopback_group, mirror_loopback_buffers  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=["ag", "rs"], default="ag")
    p.add_argument("--kind", default="bf16")
    p.add_argument("--M", type=int, default=8192)
    p.add_argument("--N", type=int, default=7168)
    p.add_argument("--K", type=int, default=8192)
    p.add_argument("--W", type=int, default=8)
    a = p.parse_args()
    g = init_loopback_group(a.W)
    if a.op == "ag":
        A, B, kw = _inputs(a.M, a.N, a.K, a.kind)
        shard, skw = _shard(A, kw, 0, a.M // a.W)
        _, fn = op_call(g, shard, B, skw)
    else:
        A, B = rs_inputs(a.M, a.N, a.K)[:2]
        _, fn = rs_op_call(g, A, B)
    for _ in range(3):
        try:
            fn()
        except RuntimeError as e:
            print(f"a warm-up call raised: {e}")
            break
    torch.cuda.synchronize()
    mirror_loopback_buffers(g)  # the peers' chunks hold real data, as in the benchmarks
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        try:
            for _ in range(2):
                with torch.profiler.record_function("mptp_call"):
                    fn()
            torch.cuda.synchronize()
        except RuntimeError as e:  # a timed-out call: its timeline is what to look at
            print(f"the call raised: {e}")
    out = os.environ.get("OUT")
    path = os.path.join(out or "/tmp", f"trace_{a.op}_{a.kind}_{a.N}_{a.K}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    calls = sorted((e for e in events if e.get("name") == "mptp_call" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])  # fmt: skip
    gpu.sort(key=lambda e: e["ts"])
    last = [e for e in gpu if e["ts"] >= calls[-1]["ts"]] if calls else gpu
    t0 = last[0]["ts"] if last else 0
    print(f"{a.op} {a.kind} M={a.M} N={a.N} K={a.K} W={a.W}: GPU events of the last call")
    for e in last:
        print(f"  +{e['ts'] - t0:9.1f}us {e['dur']:9.1f}us stream {e['args'].get('stream', '?'):>3} "
              f"{e['cat']:10s} {e['name'][:90]}")  # fmt: skip
    if last:
        print(f"  span {last[-1]['ts'] + last[-1]['dur'] - t0:.1f}us")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
    if not out:
        os.remove(path)


if __name__ == "__main__":
    main()
