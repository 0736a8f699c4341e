"""Summarizes a py-spy raw profile (py-spy record -f raw) of bench/spy_loop.py: where host time goes.

    python bench/spy_summary.py spy_ag.txt [--under run] [--top 40]

Only samples whose stack passes through a frame named --under (default: dispatch.py's run, the
op) count; samples in compilation or imports (_do_compile, _find_and_load, triton_key,
JITFunction.run) are left out. Prints the inclusive share per function, the own share per
function and the own share per line.
"""

import argparse
import re
from collections import Counter

_SKIP = ("_do_compile", "_find_and_load", "triton_key", "JITFunction.run")
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _parse(frame: str):
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip(), "?", None
    f = m.group("file")
    for cut in ("mptp_kernels/", "torch/", "triton/", "bench/"):
        if cut in f:
            f = f[f.index(cut) :]
            break
    return m.group("fn"), f, m.group("line")


def summarize(path: str, under: str, top: int) -> str:
    inclusive, own_fn, own_line = Counter(), Counter(), Counter()
    total = 0
    for raw in open(path):
        stack, _, n = raw.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [_parse(f) for f in stack.split(";")]
        names = [fn for fn, _, _ in frames]
        if under not in names or any(any(s in fn for s in _SKIP) for fn in names):
            continue
        frames = frames[names.index(under) :]
        n = int(n)
        total += n
        for key in dict.fromkeys(f"{fn} ({f})" for fn, f, _ in frames):
            inclusive[key] += n
        fn, f, line = frames[-1]
        own_fn[f"{fn} ({f})"] += n
        own_line[f"{fn} ({f}:{line})"] += n
    out = [f"samples under {under}: {total}"]
    for title, c in (("inclusive", inclusive), ("own by function", own_fn), ("own by line", own_line)):
        out.append(f"--- {title}")
        out += [f"{100.0 * v / max(total, 1):5.1f}% {k}" for k, v in c.most_common(top)]
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--under", default="run")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    print(summarize(a.path, a.under, a.top))


if __name__ == "__main__":
    main()
