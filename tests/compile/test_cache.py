"""The FX graph cache across processes (issue 11 item 2): two processes share one cache
dir, each with its own user post-grad pass chained before mptp's.

f(x, y) = x - 3y; the "plus" user passes rewrite sub -> add (x + 3y). A process must
never be served a graph compiled with another process's different pass: plain
functions have no stable uuid, so Inductor must bypass the cache; CustomGraphPass
uuids must key it (a different uuid misses, the same uuid hits).
"""

import json
import os
import subprocess
import sys

_SCRIPT = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
import mptp_kernels

aten = torch.ops.aten

def plus(graph):
    for n in graph.nodes:
        if n.target is aten.sub.Tensor:
            n.target = aten.add.Tensor

def keep(graph):
    pass

class Pass(CustomGraphPass):
    def __init__(self, fn, tag):
        self.fn, self.tag = fn, tag
    def __call__(self, graph):
        self.fn(graph)
    def uuid(self):
        return self.tag

def f(x, y):
    return x - 3 * y

x, y = torch.arange(4.0), torch.ones(4)
cfg = torch._inductor.config
out = []
for name in sys.argv[1:]:
    cfg.post_grad_custom_post_pass = {
        "plus_fn": plus, "keep_fn": keep, "plus_v1": Pass(plus, "plus-v1"), "keep_v2": Pass(keep, "keep-v2"),
        "plus_fn_list": [Pass(keep, "keep-v2"), plus],
    }[name]
    torch._dynamo.reset()
    counters.clear()
    with mptp_kernels.enable_micro_pipeline_tp(), cfg.patch(fx_graph_cache=True):
        r = torch.compile(f)(x, y)
    c = counters["inductor"]
    out.append({"name": name, "result": r.tolist(), "hit": c["fxgraph_cache_hit"],
                "miss": c["fxgraph_cache_miss"], "bypass": c["fxgraph_cache_bypass"]})
print("RESULT " + json.dumps(out))
"""

PLUS, MINUS = [3.0, 4.0, 5.0, 6.0], [-3.0, -2.0, -1.0, 0.0]


def _run(cache_dir, *scenarios):
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0",
    }
    p = subprocess.run([sys.executable, "-c", _SCRIPT, *scenarios], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return {r["name"]: r for r in json.loads(line[len("RESULT ") :])}


def test_two_processes_share_one_cache_dir(tmp_path):
    first = _run(tmp_path, "plus_fn", "plus_v1", "plus_fn_list")
    second = _run(tmp_path, "keep_fn", "keep_v2", "plus_v1", "plus_fn_list")
    assert first["plus_fn"]["result"] == PLUS and first["plus_fn"]["bypass"] >= 1
    assert first["plus_v1"]["result"] == PLUS and first["plus_v1"]["miss"] == 1
    # The failure: a second process with another plain-function pass got the first one's graph.
    assert second["keep_fn"]["result"] == MINUS, (
        "served a graph compiled with another process's pass"
    )
    assert second["keep_fn"]["bypass"] >= 1 and second["keep_fn"]["hit"] == 0
    assert second["keep_v2"]["result"] == MINUS and second["keep_v2"]["hit"] == 0, (
        "a different uuid hit"
    )
    assert second["plus_v1"]["result"] == PLUS and second["plus_v1"]["hit"] == 1, (
        "the same uuid should hit"
    )
    # A list with a plain function in it is uncacheable as a whole.
    for r in (first["plus_fn_list"], second["plus_fn_list"]):
        assert r["result"] == PLUS and r["bypass"] >= 1 and r["hit"] == 0


_WORLD_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from torch._dynamo.utils import counters
from torch.testing._internal.distributed.fake_pg import FakeStore
import mptp_kernels

W = int(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)
g = dist.group.WORLD.group_name

def f(x, w):
    _, (y,) = torch.ops.mptp.fused_all_gather_matmul(x, [w], 0, g, return_A=False)
    return torch.relu(y)

x, w = torch.randn(4, 8), torch.randn(8, 5)  # the local shard: the same at every world size
counters.clear()
with torch._inductor.config.patch(fx_graph_cache=True):
    y = torch.compile(f)(x, w)
c = counters["inductor"]
print("RESULT " + json.dumps({"shape": list(y.shape), "hit": c["fxgraph_cache_hit"], "miss": c["fxgraph_cache_miss"]}))
"""


def _run_world(cache_dir, W):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0"}
    p = subprocess.run([sys.executable, "-c", _WORLD_SCRIPT, str(W)], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_the_cache_tells_world_sizes_apart(tmp_path):
    """Found by a hostile review: an op's output shape depends on its group's size, which the
    graph names only; a second job with another world size (same local shapes, same group
    name) loaded the first one's graph and failed Inductor's size assert. The cache keys now
    hold the sizes of the groups the ops name (mptp_kernels/compile/cache_key.py)."""
    first = _run_world(tmp_path, 2)
    assert first["shape"] == [8, 5] and first["miss"] >= 1
    other = _run_world(tmp_path, 3)
    assert other["shape"] == [12, 5] and other["hit"] == 0, other
    again = _run_world(tmp_path, 2)
    assert again["shape"] == [8, 5] and again["hit"] >= 1, ("the same world size should hit", again)
