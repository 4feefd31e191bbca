#!/usr/bin/python3
"""py_overhead — time per call of deepep.Buffer's methods above the same C call (issue 17).

Each rank process of a job (worlds of 1 and 2 ranks by default, one job each, host backend
with CPU tensors or cuda with tensors on GPU 0) runs, op by op, alternating blocks of
--iters calls: the C function called through ctypes with its argument struct and outputs
made once (the "C" column; ctypes' own call is in it, given alone as "ffi"), then the
Buffer method on the same inputs (the "Python" column).  Every call is timed on its own
(thread CPU time, or wall time with --clock wall, the default on cuda), so the table gives
the median and the 99th percentile of each, and their differences: what the binding adds
per call.  Tiny inputs (4 tokens a rank, hidden 128, 4 experts, top-2) keep the operation
itself cheap.  Every rank runs the same calls in the same order (they are collective); the
table is the slowest rank's difference.  On cuda each call is followed, outside its timing,
by a synchronise, so that the launch queue never backs up and each timing is the host's
time in that call (dispatch's includes its wait for the row count, on both sides).

The "floor" column is what torch alone costs per call of each method, measured in the same
process: the fresh output tensors that DeepEP's contract makes each method return, each at
the cheapest torch makes one (empty_like of a prototype; dispatch's three are then shrunk to
the rows received, a resize_ each, counted too); "above floor" is the rest of the binding's
work (checks, struct, Handle, result tuple).  The per-call clock reads are in every figure,
C and Python alike, so they cancel in the differences.  dispatch's C call writes int64 ids
(recv_index_type DEP_INDEX_I64), as the binding's does; it does not ask for the counts on the
host (recv_count_per_expert_host), which the binding's does, so that its figures stay those of
the calls before it: on cuda that copy is in the Python column's C call.  A line of single
torch calls follows (other ways to shrink an output than resize_, and on cuda the current
stream's lookups, the capture check, an event's record and query), to place what is left.

--against DIR times a second package beside this one in the same processes: DIR holds a
copy of an older python/deepep (e.g. `git archive REV python/deepep | tar -x -C /tmp/old`
gives DIR=/tmp/old/python/deepep), imported as deepep_old, with a Buffer of its own (another
job on the same daemon); its blocks alternate with the C and the new package's, so that a
before/after comparison is not at the mercy of a machine whose speed drifts between runs.

  DEP_BUILD=build PYTHONPATH=python /usr/bin/python3 bench/py_overhead.py \\
    [-s SOCKET] [--world 1,2] [--iters N] [--blocks B] [--device cpu|cuda] [-o RAW.csv]
    [--against DIR]

Without -s it starts $DEP_BUILD/deepepd (default build/) on a temporary socket, with the
host backend (--device cpu, the default) or the cuda backend (--device cuda; it says it
skips and exits 0 where torch has no CUDA), outside MPS (the CUDA_MPS_* variables left out
of its environment; the rank processes keep them: a world of 2 on one GPU needs MPS, else
each call waits for the other process's time slice).  -s SOCKET uses a running daemon of
the matching backend.  On the GPU machine (DEVICE.md), from the repository root:

  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; \
  mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d; \
  DEP_BUILD=build-gpu python3 bench/py_overhead.py --device cuda \
    -o bench/results/py-overhead-cuda.csv | tee bench/results/py-overhead-cuda.txt; \
  echo quit | nvidia-cuda-mps-control
"""
import argparse
import ctypes
import importlib.util
import json
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

H, E, K, N, M = 128, 4, 2, 4, 8
OPS = ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch",
       "low_latency_combine")


def pct(v, q):
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def import_old(path):
    """The package in directory `path`, imported as deepep_old (its relative imports with it)."""
    spec = importlib.util.spec_from_file_location(
        "deepep_old", os.path.join(path, "__init__.py"), submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["deepep_old"] = mod
    spec.loader.exec_module(mod)
    return mod


def worker(o):
    """One rank: attach, run every op's blocks, print the per-call samples as JSON."""
    import torch

    import deepep
    from deepep import _lib

    cuda = o.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    clock = time.perf_counter_ns if o.clock == "wall" else time.thread_time_ns
    sync = torch.cuda.synchronize if cuda else None
    r, w = o.rank, o.world
    shape = dict(rank=r, world_size=w, local_rank=r, local_world_size=w, socket=o.socket,
                 hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=M,
                 max_ll_tokens_per_rank=M)
    b = deepep.Buffer(job_id=o.job, **shape)
    old = import_old(o.against).Buffer(job_id=o.job + "-old", **shape) if o.against else None
    lib, c = b._conn.lib, b._conn.ptr
    st = None if not cuda else torch.cuda.current_stream(dev).cuda_stream
    rows, L, llrows = b.sizes["recv_rows"], b.sizes["local_experts"], b.sizes["ll_recv_rows"]
    x = torch.ones(N, H, dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[(t + r) % E, (t + r + 1) % E] for t in range(N)], dtype=torch.int64,
                       device=dev)
    wt = torch.full((N, K), 0.5, device=dev)

    # The C calls: arguments and outputs made once.
    def empty(*shape, dtype):
        return torch.empty(shape, dtype=dtype, device=dev)
    per_rank, per_expert = empty(w, dtype=torch.int32), empty(E, dtype=torch.int32)
    in_rank = empty(N, w, dtype=torch.bool)
    la = _lib.LayoutArgs(idx.data_ptr(), _lib.INDEX_I64, N, per_rank.data_ptr(),
                         per_expert.data_ptr(), in_rank.data_ptr())
    rx, ri = empty(rows, H, dtype=torch.bfloat16), empty(rows, K, dtype=torch.int64)
    rw, cnt = empty(rows, K, dtype=torch.float32), empty(L, dtype=torch.int32)
    nrecv = ctypes.c_uint32()
    h, lh = ctypes.c_void_p(), ctypes.c_void_p()
    lib.dep_handle_new(c, ctypes.byref(h))
    lib.dep_handle_new(c, ctypes.byref(lh))
    da = _lib.DispatchArgs(x.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, wt.data_ptr(), N,
                           rx.data_ptr(), ri.data_ptr(), rw.data_ptr(), cnt.data_ptr(),
                           ctypes.addressof(nrecv))
    da.recv_index_type = _lib.INDEX_I64
    out = empty(N, H, dtype=torch.bfloat16)
    llx, llc = empty(L, llrows, H, dtype=torch.bfloat16), empty(L, dtype=torch.int32)
    lla = _lib.LLDispatchArgs(x.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, N, 0,
                              llx.data_ptr(), None, llc.data_ptr())
    lca = _lib.LLCombineArgs(llx.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, wt.data_ptr(),
                             out.data_ptr())

    def c_call(fn, *args):
        def call():
            rc = fn(*args)
            if rc != 0:
                raise RuntimeError(b._conn.errmsg())
        return call

    lib.dep_dispatch(c, ctypes.byref(da), h, st)
    ca = _lib.CombineArgs(rx.data_ptr(), out.data_ptr())
    lib.dep_ll_dispatch(c, ctypes.byref(lla), lh, st)
    recv, _, _, _, ph, _ = b.dispatch(x, topk_idx=idx, topk_weights=wt)
    _, _, plh, _, _ = b.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    ref = ctypes.byref
    olds = {}
    if old is not None:
        orecv, _, _, _, oph, _ = old.dispatch(x, topk_idx=idx, topk_weights=wt)
        _, _, oplh, _, _ = old.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        olds = {
            "get_dispatch_layout": lambda: old.get_dispatch_layout(idx, E),
            "dispatch": lambda: old.dispatch(x, topk_idx=idx, topk_weights=wt),
            "combine": lambda: old.combine(orecv, oph),
            "low_latency_dispatch": lambda: old.low_latency_dispatch(x, idx, M, E,
                                                                     use_fp8=False),
            "low_latency_combine": lambda: old.low_latency_combine(llx, idx, wt, oplh),
        }
    pairs = {
        "get_dispatch_layout": (lambda: b.get_dispatch_layout(idx, E),
                                c_call(lib.dep_layout, c, ref(la), st)),
        "dispatch": (lambda: b.dispatch(x, topk_idx=idx, topk_weights=wt),
                     c_call(lib.dep_dispatch, c, ref(da), h, st)),
        "combine": (lambda: b.combine(recv, ph), c_call(lib.dep_combine, c, ref(ca), h, st)),
        "low_latency_dispatch": (lambda: b.low_latency_dispatch(x, idx, M, E, use_fp8=False),
                                 c_call(lib.dep_ll_dispatch, c, ref(lla), lh, st)),
        "low_latency_combine": (lambda: b.low_latency_combine(llx, idx, wt, plh),
                                c_call(lib.dep_ll_combine, c, ref(lca), lh, st)),
    }

    def block(fn, n):
        v = [0] * n
        for i in range(n):
            t0 = clock()
            fn()
            v[i] = clock() - t0
            if sync is not None:
                sync()
        return v

    res = {"rank": r, "ops": {}}
    for name in OPS:
        py, cc = pairs[name]
        po = olds.get(name)
        block(cc, 50)  # warm each, on every rank alike
        block(py, 50)
        if po is not None:
            block(po, 50)
        sc, sp, so = [], [], []
        for _ in range(o.blocks):
            sc += block(cc, o.iters)
            sp += block(py, o.iters)
            if po is not None:
                so += block(po, o.iters)
        res["ops"][name] = {"c": sc, "py": sp, "old": so}
    ffi = lib.dep_errname
    res["ffi"] = block(lambda: ffi(0), o.iters)
    # torch's own share: the outputs each method allocates (DeepEP's contract: fresh ones).
    # The cheapest fresh tensor torch makes: empty_like of a one-element prototype expanded
    # to the shape (what the binding uses), beside torch.empty; and one made at twice the
    # rows and shrunk (dispatch's outputs, made at the capacity before the row count is known).
    small = block(lambda: torch.empty((N, H), dtype=torch.bfloat16, device=dev), o.iters)
    proto = torch.empty((1,), dtype=torch.bfloat16, device=dev).expand(N, H)
    like = block(lambda: torch.empty_like(proto), o.iters)
    pbig = torch.empty((1,), dtype=torch.bfloat16, device=dev).expand(2 * N, H)
    shrunk = block(lambda: torch.empty_like(pbig).resize_((N, H)), o.iters)
    res["empty"], res["like"], res["shrunk"] = small, like, shrunk
    # The torch calls the binding makes per call, or chose against, timed alone: other ways
    # to shrink an output made at the capacity (in place of resize_), and on cuda the current
    # stream's lookups, the capture check and an event recorded.
    probes = {"as_strided_": lambda: torch.empty_like(pbig).as_strided_((N, H), (H, 1)),
              "sliced": lambda: torch.empty_like(pbig)[:N]}
    if cuda:
        probes["current_stream"] = lambda: torch.cuda.current_stream(dev)
        if hasattr(torch._C, "_cuda_getCurrentRawStream"):
            probes["raw_stream"] = lambda: torch._C._cuda_getCurrentRawStream(0)
        probes["is_capturing"] = torch.cuda.is_current_stream_capturing
        ev = torch.cuda.Event()
        cur = torch.cuda.current_stream(dev)
        probes["event_record"] = lambda: ev.record(cur)
        probes["event_query"] = ev.query
    res["probes"] = {k: block(f, o.iters) for k, f in probes.items()}
    lib.dep_handle_free(h)
    lib.dep_handle_free(lh)
    b.destroy()
    if old is not None:
        old.destroy()
    json.dump(res, sys.stdout)


# Per method: the fresh output tensors it must make as they are, and those it makes at the
# capacity and shrinks to the rows received, as DeepEP returns them.
FLOOR = {"get_dispatch_layout": (3, 0), "dispatch": (0, 3), "combine": (1, 0),
         "low_latency_dispatch": (2, 0), "low_latency_combine": (1, 0)}


def start_daemon(device):
    d = tempfile.mkdtemp(prefix="py_overhead.")
    sock, conf = os.path.join(d, "d.sock"), os.path.join(d, "c.yaml")
    with open(conf, "w") as f:
        if device == "cuda":
            f.write(f"socket:\n  path: {sock}\nbackend: cuda\npool:\n  size_per_device: 16GiB\n"
                    "  chunk_size: 1GiB\n  host_size: 1GiB\n")
        else:
            f.write(f"socket:\n  path: {sock}\nbackend: host\n"
                    "pool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n")
    # The daemon outside MPS (DEVICE.md): without the MPS pipe directory the ranks use.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    p = subprocess.Popen([os.path.join(BUILD, "deepepd"), "-s", sock, "-c", conf], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import deepep
    for _ in range(3000):
        try:
            b = deepep.Buffer(job_id="probe-" + uuid.uuid4().hex[:6], rank=0, world_size=1,
                              socket=sock)
            b.destroy()
            return p, sock
        except deepep.NoDaemon:
            if p.poll() is not None:
                break
            time.sleep(0.01)
    p.kill()
    sys.exit(f"py_overhead: {BUILD}/deepepd did not start")


def run_world(o, sock, world):
    job = f"py-overhead-{world}-{uuid.uuid4().hex[:8]}"
    procs = []
    for r in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(r),
               "--world", str(world), "--job", job, "-s", sock, "--iters", str(o.iters),
               "--blocks", str(o.blocks), "--device", o.device, "--clock", o.clock] + \
            (["--against", o.against] if o.against else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE))
    outs = []
    for r, p in enumerate(procs):
        data, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            sys.exit(f"py_overhead: rank {r} of world {world} failed (exit {p.returncode})")
        outs.append(json.loads(data))
    return outs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-s", "--socket")
    ap.add_argument("--world", default="1,2", help="worlds to run, e.g. 1,2 (each a job)")
    ap.add_argument("--iters", type=int, default=2000, help="calls per block")
    ap.add_argument("--blocks", type=int, default=5, help="alternating C/Python blocks per op")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--clock", choices=("cpu", "wall"))
    ap.add_argument("-o", "--output", help="CSV of every rank's medians and p99s")
    ap.add_argument("--against", metavar="DIR",
                    help="also time the package in DIR (an older python/deepep) as deepep_old")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    o = ap.parse_args()
    o.clock = o.clock or ("wall" if o.device == "cuda" else "cpu")
    if o.worker:
        o.world = int(o.world)
        worker(o)
        return
    import torch
    if o.device == "cuda" and not torch.cuda.is_available():
        print(f"py_overhead: skip: --device cuda, but torch {torch.__version__} has no CUDA "
              "device here")
        return
    worlds = [int(v) for v in o.world.split(",")]
    proc, sock = (None, o.socket) if o.socket else start_daemon(o.device)
    rows = []
    try:
        print(f"py_overhead: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, python "
              f"{sys.version.split()[0]}, torch {torch.__version__}, {o.device} tensors, "
              f"{N} tokens a rank, hidden {H}, {E} experts, top-{K}; {o.clock} time per "
              f"call in us, {o.blocks} x {o.iters} calls per side, each timed alone; "
              f"load average {os.getloadavg()[0]:.1f}")
        for world in worlds:
            outs = run_world(o, sock, world)
            ffi = max(statistics.median(x["ffi"]) for x in outs) / 1e3
            emp = max(statistics.median(x["empty"]) for x in outs) / 1e3
            like = max(statistics.median(x["like"]) for x in outs) / 1e3
            shr = max(statistics.median(x["shrunk"]) for x in outs) / 1e3
            print(f"\nworld {world}: ffi (a ctypes call of dep_errname) {ffi:.2f}; one small "
                  f"output: torch.empty {emp:.2f}, empty_like of a prototype {like:.2f}, "
                  f"the same made at twice the rows and shrunk {shr:.2f} (each timed alone, "
                  "as the calls)")
            names = list(outs[0]["probes"])
            print("torch calls, each timed alone: " + ", ".join(
                f"{k} {max(statistics.median(x['probes'][k]) for x in outs) / 1e3:.2f}"
                for k in names) + " (as_strided_ and sliced: made at twice the rows, as shrunk)")
            print(f"{'method':<22} {'C med':>7} {'Py med':>7} {'above':>7}   {'C p99':>7} "
                  f"{'Py p99':>7} {'above':>7}   {'floor':>6}  {'above floor':>11}" +
                  (f"   {'old med':>7} {'old above':>9} {'new-old':>7}" if o.against else ""))
            for name in OPS:
                per = []
                for x in outs:
                    c, p, q = (x["ops"][name][s] for s in ("c", "py", "old"))
                    per.append((statistics.median(c) / 1e3, statistics.median(p) / 1e3,
                                pct(c, 0.99) / 1e3, pct(p, 0.99) / 1e3,
                                statistics.median(q) / 1e3 if q else float("nan")))
                    rows.append((world, x["rank"], name) + per[-1])
                cm, pm, c99, p99, om = max(per, key=lambda v: v[1] - v[0])
                ne, ns = FLOOR[name]
                floor = ne * like + ns * shr
                print(f"{name:<22} {cm:7.2f} {pm:7.2f} {pm - cm:7.2f}   {c99:7.2f} {p99:7.2f} "
                      f"{p99 - c99:7.2f}   {floor:6.2f}  {pm - cm - floor:11.2f}" +
                      (f"   {om:7.2f} {om - cm:9.2f} {pm - om:7.2f}" if o.against else ""))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    if o.output:
        with open(o.output, "w") as f:
            f.write("world,rank,op,c_median_us,py_median_us,c_p99_us,py_p99_us,"
                    "old_median_us\n")
            for row in rows:
                f.write(",".join(str(v) if isinstance(v, (int, str)) else f"{v:.3f}"
                                 for v in row) + "\n")


if __name__ == "__main__":
    main()
