#!/usr/bin/env python3
"""py_restart — a trainer's restart on one GPU: N rank processes (8, under MPS) from process
start to the first dispatch's result, split into phases; beside it, in the same run, one
process's torch.distributed.init_process_group("nccl") and its first all_to_all_single of the
same bytes (issue 17).

  DEEPEP_CLIENT_LIB=build/libdeepep-client.so.0 PYTHONPATH=python \\
    python3 bench/py_restart.py -s SOCKET [-n 8] [-r 3] [-t 4096] [-l 128] [-H 7168]
                                [-e 256] [-k 8] [--no-barrier] [-o RAW.csv]

SOCKET is a running deepepd's (the cuda backend for the figures that matter; the host
backend works too, with CPU tensors).  Each run starts N fresh interpreters at once, each
timed on CLOCK_MONOTONIC (one clock for every process) from just before the parent's
Popen of it:

  import   process start to `import torch, deepep` done (the interpreter's own start too)
  cuda     the CUDA context (torch.cuda.init, a tensor made and synchronised) and the inputs
           (random x, top-k ids and weights, made on the GPU)
  buffer   deepep.Buffer(...) with the job's shape: connect, attach (the rendezvous of the
           N ranks, mapping every local slab, loading the kernels)
  first    the first dispatch (bf16, -t tokens), to its result on the host (dep_dispatch
           synchronises: its row count is a host value)
  first_ll the first low_latency_dispatch (-l tokens) after it, to torch.cuda.synchronize()
  second   (after total) a second dispatch of the same tokens: the call's own cost warm

Between cuda and buffer the ranks wait for one another (a barrier through their pipes), so
that buffer is each rank's own attach, not the wait for the slowest interpreter's import;
--no-barrier leaves it out (buffer then includes that wait).  The NCCL process runs after
the N ranks, alone: import, cuda (as above), init (init_process_group("nccl"), one rank,
file:// rendezvous: with no device_id NCCL makes its communicator at the first collective),
first (all_to_all_single of the bytes one rank's dispatch sends: t tokens x (2H + 8K + 4K +
16)), then the same with device_id given (eager: the communicator is made in init).  Each
figure is printed per rank; the summary gives, per phase, the median over runs of the
slowest rank.  Raw rows go to -o (CSV).
"""
import time

T_MAIN = time.monotonic_ns()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

MS = 1e6


def _since(t0):
    return (time.monotonic_ns() - t0) / MS


def child_deepep(a):
    t0 = int(os.environ["PY_RESTART_T0"])
    out = {"pid": os.getpid(), "interp_ms": (T_MAIN - t0) / MS}
    import torch
    import deepep
    out["import_ms"] = _since(t0)
    t = time.monotonic_ns()
    cuda = torch.cuda.is_available() and a.backend == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.init()
        torch.cuda.set_device(dev)
        torch.empty(1, device=dev)
        torch.cuda.synchronize()
    out["ctx_only_ms"] = _since(t)
    g = torch.Generator(device=dev).manual_seed(a.rank)
    x = torch.randn(a.tokens, a.hidden, device=dev, generator=g).bfloat16()
    idx = torch.rand(a.tokens, a.experts, device=dev, generator=g).topk(a.topk, dim=1).indices
    w = torch.rand(a.tokens, a.topk, device=dev, generator=g)
    lx, lidx = x[:a.ll_tokens].contiguous(), idx[:a.ll_tokens].contiguous()
    if cuda:
        torch.cuda.synchronize()
    out["cuda_ms"] = _since(t)
    if a.barrier:
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":
            raise SystemExit("no GO from the parent")
    t = time.monotonic_ns()
    b = deepep.Buffer(job_id=a.job, rank=a.rank, world_size=a.world, local_rank=a.rank,
                      local_world_size=a.world, socket=a.socket, hidden=a.hidden,
                      num_experts=a.experts, num_topk=a.topk, max_tokens_per_rank=a.tokens,
                      max_ll_tokens_per_rank=a.ll_tokens)
    out["buffer_ms"] = _since(t)
    out.update({"init_" + k: v for k, v in b.init_times.items()})
    t = time.monotonic_ns()
    recv_x, _, _, counts, handle, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
    out["first_ms"] = _since(t)
    out["recv_rows"] = int(recv_x.size(0))
    t = time.monotonic_ns()
    recv, count, _, _, _ = b.low_latency_dispatch(lx, lidx, a.ll_tokens, a.experts,
                                                  use_fp8=False)
    if cuda:
        torch.cuda.synchronize()
    out["first_ll_ms"] = _since(t)
    out["total_ms"] = _since(t0)
    t = time.monotonic_ns()
    del recv_x, handle
    again = b.dispatch(x, topk_idx=idx, topk_weights=w)
    out["second_ms"] = _since(t)
    assert again[0].size(0) == out["recv_rows"] and again[3] == counts  # the same routing
    out.update({"attach_" + k: v for k, v in b.attach_times().items()})
    b.destroy()
    print("RESULT " + json.dumps(out), flush=True)


def child_nccl(a):
    t0 = int(os.environ["PY_RESTART_T0"])
    out = {"pid": os.getpid(), "interp_ms": (T_MAIN - t0) / MS}
    import torch
    import torch.distributed as dist
    out["import_ms"] = _since(t0)
    t = time.monotonic_ns()
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    torch.cuda.synchronize()
    nbytes = a.tokens * (2 * a.hidden + 8 * a.topk + 4 * a.topk + 16)
    inp = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    o = torch.empty_like(inp)
    torch.cuda.synchronize()
    out["cuda_ms"] = _since(t)
    out["bytes"] = nbytes
    for mode in ("lazy", "eager"):
        store = f"file://{a.nccl_dir}/{mode}"
        t = time.monotonic_ns()
        kw = {"device_id": dev} if mode == "eager" else {}
        dist.init_process_group("nccl", init_method=store, rank=0, world_size=1, **kw)
        out[f"{mode}_init_ms"] = _since(t)
        t = time.monotonic_ns()
        dist.all_to_all_single(o, inp)
        torch.cuda.synchronize()
        out[f"{mode}_first_ms"] = _since(t)
        assert torch.equal(o, inp)
        if mode == "lazy":
            out["lazy_total_ms"] = _since(t0)
        dist.destroy_process_group()
    import torch.cuda.nccl as nccl
    out["nccl"] = ".".join(map(str, nccl.version())) if hasattr(nccl, "version") else "?"
    out["torch"] = torch.__version__
    print("RESULT " + json.dumps(out), flush=True)


def spawn(args, env):
    import subprocess
    env = dict(env)
    env["PY_RESTART_T0"] = str(time.monotonic_ns())
    return subprocess.Popen([sys.executable, os.path.abspath(__file__)] + args, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def result(p, timeout):
    out, _ = p.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child {p.pid} (rc {p.returncode}) gave no result:\n{out}")


def main():
    import argparse
    import statistics
    import tempfile
    import uuid
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-s", "--socket", default=os.environ.get("DEEPEPD_SOCKET"))
    ap.add_argument("-n", "--world", type=int, default=8)
    ap.add_argument("-r", "--runs", type=int, default=3)
    ap.add_argument("-t", "--tokens", type=int, default=4096)
    ap.add_argument("-l", "--ll-tokens", type=int, default=128)
    ap.add_argument("-H", "--hidden", type=int, default=7168)
    ap.add_argument("-e", "--experts", type=int, default=256)
    ap.add_argument("-k", "--topk", type=int, default=8)
    ap.add_argument("-b", "--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--no-barrier", dest="barrier", action="store_false")
    ap.add_argument("--no-nccl", dest="nccl", action="store_false")
    ap.add_argument("-o", "--output")
    ap.add_argument("--child", choices=["deepep", "nccl"])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--job")
    ap.add_argument("--nccl-dir")
    a = ap.parse_args()
    if a.child == "deepep":
        return child_deepep(a)
    if a.child == "nccl":
        return child_nccl(a)
    if not a.socket:
        raise SystemExit("py_restart: -s SOCKET (a running deepepd's) is required")
    common = ["-s", a.socket, "-n", str(a.world), "-t", str(a.tokens), "-l", str(a.ll_tokens),
              "-H", str(a.hidden), "-e", str(a.experts), "-k", str(a.topk), "-b", a.backend]
    if not a.barrier:
        common.append("--no-barrier")
    print(f"# py_restart: {a.world} rank processes, {a.runs} runs, dispatch {a.tokens} tokens, "
          f"LL {a.ll_tokens}, hidden {a.hidden}, {a.experts} experts, top-{a.topk}, backend "
          f"{a.backend}, barrier before Buffer: {a.barrier}; python {sys.version.split()[0]}",
          flush=True)
    phases = ["import_ms", "cuda_ms", "buffer_ms", "first_ms", "first_ll_ms", "second_ms"]
    rows, slowest = [], {k: [] for k in phases + ["buffer+first_ms", "total_ms"]}
    for run in range(a.runs):
        job = f"py-restart-{run}-{uuid.uuid4().hex[:8]}"
        ps = [spawn(["--child", "deepep", "--rank", str(r), "--job", job] + common, os.environ)
              for r in range(a.world)]
        if a.barrier:
            for p in ps:
                line = p.stdout.readline()
                if line.strip() != "READY":
                    raise RuntimeError(f"rank {ps.index(p)}: {line!r} {p.communicate()}")
            for p in ps:
                p.stdin.write("GO\n")
                p.stdin.flush()
        res = [result(p, 300) for p in ps]
        print(f"run {run}: rank  import  cuda(ctx only)  buffer  first  first_ll  "
              "buffer+first  total (ms)   | second; Buffer's parts; dep_attach's parts")
        for r, x in enumerate(res):
            x["buffer+first_ms"] = x["buffer_ms"] + x["first_ms"]
            x.update(run=run, rank=r, kind="deepep")
            rows.append(x)
            print(f"  {r:2d}  {x['import_ms']:8.1f}  {x['cuda_ms']:7.1f} ({x['ctx_only_ms']:6.1f})"
                  f"  {x['buffer_ms']:7.2f}  {x['first_ms']:6.2f}  {x['first_ll_ms']:7.2f}"
                  f"  {x['buffer+first_ms']:10.2f}  {x['total_ms']:8.1f}   | {x['second_ms']:.2f}; "
                  + " ".join(f"{k[5:]} {v:.2f}" for k, v in x.items() if k.startswith("init_"))
                  + "; " + " ".join(f"{k[7:-3]} {x[k]:.2f}" for k in
                                    ("attach_wait_ms", "attach_map_ms", "attach_setup_ms",
                                     "attach_warmup_ms")) + f"; rows {x['recv_rows']}")
        for k in slowest:
            slowest[k].append(max(x[k] for x in res))
        ok = all(x["buffer+first_ms"] <= 10 for x in res)
        print(f"  Buffer(...) + first call <= 10 ms for every rank: {'yes' if ok else 'NO'}",
              flush=True)
    print("summary (median over runs of the slowest rank, ms): " +
          ", ".join(f"{k[:-3]} {statistics.median(v):.2f}" for k, v in slowest.items()))
    if a.nccl and a.backend == "cuda":
        for run in range(a.runs):
            d = tempfile.mkdtemp(prefix="py_restart_nccl.")
            p = spawn(["--child", "nccl", "--nccl-dir", d] + common, os.environ)
            x = result(p, 300)
            x.update(run=run, rank=0, kind="nccl")
            rows.append(x)
            print(f"nccl run {run} (torch {x['torch']}, NCCL {x['nccl']}, {x['bytes']} bytes): "
                  f"import {x['import_ms']:.1f}, cuda {x['cuda_ms']:.1f}, "
                  f"init_process_group {x['lazy_init_ms']:.2f}, first all_to_all_single "
                  f"{x['lazy_first_ms']:.2f}, init+first {x['lazy_init_ms'] + x['lazy_first_ms']:.2f}"
                  f"; with device_id (eager): init {x['eager_init_ms']:.2f}, first "
                  f"{x['eager_first_ms']:.2f}", flush=True)
    if a.output:
        import csv
        keys = sorted({k for r in rows for k in r})
        with open(a.output, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=keys)
            wr.writeheader()
            wr.writerows(rows)


if __name__ == "__main__":
    main()
