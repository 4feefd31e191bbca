#!/usr/bin/python3
"""py_overhead — CPU time per call of deepep.Buffer's methods above the C call.

One rank of a one-rank job on the host backend, tiny inputs (4 tokens,
hidden 128, 4 experts, top-2), so that the operation itself is cheap and the
difference is the Python layer's: argument checks, output tensors, the
struct and the result tuple.  Each method is timed beside the same C
function called through ctypes with its arguments and outputs made once
(the "C" column; it includes ctypes' own call cost, given on its own as
"ffi", a call of dep_errname).  Figures are CPU time (thread_time) per call,
the median of --repeat runs of --iters calls.

  DEEPEP_CLIENT_LIB=build/libdeepep-client.so.0 PYTHONPATH=python \\
    /usr/bin/python3 bench/py_overhead.py [-s SOCKET] [--iters N] [--repeat R]

Without -s it starts build/deepepd (or $DEP_BUILD's) on a temporary socket.
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("DEP_BUILD") or os.path.join(REPO, "build")
os.environ.setdefault("DEEPEP_CLIENT_LIB", os.path.join(BUILD, "libdeepep-client.so.0"))
sys.path.insert(0, os.path.join(REPO, "python"))

import torch  # noqa: E402

import deepep  # noqa: E402
from deepep import _lib  # noqa: E402


def per_call_us(fn, iters, repeat):
    fn()
    runs = []
    for _ in range(repeat):
        t0 = time.thread_time_ns()
        for _ in range(iters):
            fn()
        runs.append((time.thread_time_ns() - t0) / iters / 1e3)
    return statistics.median(runs)


def start_daemon():
    d = tempfile.mkdtemp(prefix="py_overhead.")
    sock, conf = os.path.join(d, "d.sock"), os.path.join(d, "c.yaml")
    with open(conf, "w") as f:
        f.write(f"socket:\n  path: {sock}\nbackend: host\n"
                "pool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n")
    p = subprocess.Popen([os.path.join(BUILD, "deepepd"), "--backend", "host", "-s", sock,
                          "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(3000):
        try:
            b = deepep.Buffer(job_id="probe-" + uuid.uuid4().hex[:6], rank=0, world_size=1,
                              socket=sock)
            b.destroy()
            return p, sock
        except deepep.NoDaemon:
            time.sleep(0.01)
    p.kill()
    sys.exit("py_overhead: deepepd did not start")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-s", "--socket")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    o = ap.parse_args()
    proc = None
    sock = o.socket
    if sock is None:
        proc, sock = start_daemon()
    try:
        run(sock, o.iters, o.repeat)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


def run(sock, iters, repeat):
    H, E, K, N, M = 128, 4, 2, 4, 8
    b = deepep.Buffer(job_id="py-overhead-" + uuid.uuid4().hex[:8], rank=0, world_size=1,
                      socket=sock, hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=M,
                      max_ll_tokens_per_rank=M)
    lib, c = b._conn.lib, b._conn.ptr
    x = torch.ones(N, H, dtype=torch.bfloat16)
    idx = torch.tensor([[t % E, (t + 1) % E] for t in range(N)], dtype=torch.int64)
    w = torch.full((N, K), 0.5)

    # The C calls, arguments and outputs made once.
    per_rank, per_expert = torch.empty(1, dtype=torch.int32), torch.empty(E, dtype=torch.int32)
    in_rank = torch.empty(N, 1, dtype=torch.bool)
    la = _lib.LayoutArgs(idx.data_ptr(), _lib.INDEX_I64, N, per_rank.data_ptr(),
                         per_expert.data_ptr(), in_rank.data_ptr())
    rx, ri = torch.empty(M, H, dtype=torch.bfloat16), torch.empty(M, K, dtype=torch.int32)
    rw, cnt = torch.empty(M, K), torch.empty(E, dtype=torch.int32)
    nrecv = ctypes.c_uint32()
    h = ctypes.c_void_p()
    lib.dep_handle_new(c, ctypes.byref(h))
    da = _lib.DispatchArgs(x.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, w.data_ptr(), N,
                           rx.data_ptr(), ri.data_ptr(), rw.data_ptr(), cnt.data_ptr(),
                           ctypes.addressof(nrecv))
    out = torch.empty(N, H, dtype=torch.bfloat16)
    lib.dep_dispatch(c, ctypes.byref(da), h, None)
    ca = _lib.CombineArgs(rx.data_ptr(), out.data_ptr())
    llx = torch.empty(E, M, H, dtype=torch.bfloat16)
    llc = torch.empty(E, dtype=torch.int32)
    lh = ctypes.c_void_p()
    lib.dep_handle_new(c, ctypes.byref(lh))
    lla = _lib.LLDispatchArgs(x.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, N, 0, llx.data_ptr(),
                              None, llc.data_ptr())
    lib.dep_ll_dispatch(c, ctypes.byref(lla), lh, None)
    lca = _lib.LLCombineArgs(llx.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, w.data_ptr(),
                             out.data_ptr())

    def c_call(fn, *args):
        def call():
            rc = fn(*args)
            assert rc == 0, b._conn.errmsg()
        return call

    _, _, _, _, ph, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
    recv = b.dispatch(x, topk_idx=idx, topk_weights=w)[0]
    _, _, plh, _, _ = b.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    pairs = [
        ("get_dispatch_layout", lambda: b.get_dispatch_layout(idx, E),
         c_call(lib.dep_layout, c, ctypes.byref(la), None)),
        ("dispatch", lambda: b.dispatch(x, topk_idx=idx, topk_weights=w),
         c_call(lib.dep_dispatch, c, ctypes.byref(da), h, None)),
        ("combine", lambda: b.combine(recv, ph),
         c_call(lib.dep_combine, c, ctypes.byref(ca), h, None)),
        ("low_latency_dispatch", lambda: b.low_latency_dispatch(x, idx, M, E, use_fp8=False),
         c_call(lib.dep_ll_dispatch, c, ctypes.byref(lla), lh, None)),
        ("low_latency_combine", lambda: b.low_latency_combine(llx, idx, w, plh),
         c_call(lib.dep_ll_combine, c, ctypes.byref(lca), lh, None)),
    ]
    ffi = per_call_us(lambda: lib.dep_errname(0), iters, repeat)
    print(f"py_overhead: torch {torch.__version__}, {N} tokens, hidden {H}, {E} experts, "
          f"top-{K}, one rank, host backend; CPU us per call (median of {repeat} x {iters})")
    print(f"ffi (ctypes call of dep_errname): {ffi:.2f} us")
    print(f"{'method':<22} {'Python':>8} {'C':>8} {'above C':>8}")
    for name, py, cc in pairs:
        tp, tc = per_call_us(py, iters, repeat), per_call_us(cc, iters, repeat)
        print(f"{name:<22} {tp:8.2f} {tc:8.2f} {tp - tc:8.2f}")
    lib.dep_handle_free(h)
    lib.dep_handle_free(lh)
    b.destroy()


if __name__ == "__main__":
    main()
