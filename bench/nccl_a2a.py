#!/usr/bin/env python3
"""nccl_a2a.py — the NCCL baseline for bench/ep (issue 5): PyTorch's
all_to_all_single moving, between the same GPUs (one rank per GPU, ranks as
processes), the same bytes per rank that bench/ep's operations move.

  python3 bench/nccl_a2a.py [-n 2,4,8] [-c CALLS] [-w WARMUP] [-t 4096] [-l 128]
                            [-H 7168] [-e 256] [-k 8] [-x SEED] [-o RAW.csv] [-L]

Routing is bench/ep's own: the same splitmix64 streams and seed give every
rank's token the same top-k distinct experts, expert e lives on rank
e // (experts / world), and a token goes once to each rank owning one of its
experts.  Bytes each rank sends to each rank (its own share included, as
bench/ep counts it):
  dispatch         rows x (2H + 16 + 8K)
  combine          the reverse: one 2H vector per row received
  ll_dispatch      first L tokens: per row 2H + 16 + 4 x (its experts on that rank)
  ll_dispatch_fp8  the same with an FP8 payload: H + 4H/128 + 16 + 4 x ids
  ll_combine       the reverse: one 2H vector per (token, expert on that rank)
Every rank knows every split (the routing is seeded), so one all_to_all_single
on a uint8 tensor per call moves exactly those bytes.

Timing: init_ms is init_process_group after all ranks have a CUDA context
(with device_id the NCCL communicator is made there, eagerly; -L leaves it
out so the first collective makes it).  first_ms is each op's first call
(the first dispatch is the group's first collective: NCCL's connection
set-up lands there).  Then WARMUP untimed and CALLS timed calls, an
all_reduce of one element plus a synchronise (untimed) before each so the
ranks start together; CUDA events around each call.  A call's time is the
slowest rank's; median and p99 over calls.  GB/s per rank = mean bytes sent
per rank / median.  Each op's first call is checked: the split sizes every
rank reports (exchanged afterwards) and a byte pattern per (source, dest).

Raw CSV (-o, appended): nccl,world,op,kind,index,ms with kind init/first
(index 0, slowest rank), call (index = call, slowest rank) and init@R,
first@R, call@R for rank R alone.
"""
import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ["dispatch", "combine", "ll_dispatch", "ll_dispatch_fp8", "ll_combine"]
M64 = (1 << 64) - 1


def mix(s):
    """bench/ep's splitmix64 step: returns (new state, output)."""
    s = (s + 0x9E3779B97F4A7C15) & M64
    z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return s, z ^ (z >> 31)


def gen_idx(a, r):
    """Rank r's top-k distinct experts per token, as bench/ep's gen_idx."""
    s = (a.seed * 1000003 + r * 7919 + 1) & M64
    out = []
    for _ in range(a.tokens):
        row = []
        while len(row) < a.topk:
            s, z = mix(s)
            if z % a.experts not in row:
                row.append(z % a.experts)
        out.append(row)
    return out


def split_bytes(a, n):
    """bytes[op][src][dst] for world n, from every rank's routing."""
    H, K, le = a.hidden, a.topk, a.experts // n
    b = {op: [[0] * n for _ in range(n)] for op in OPS}
    for src in range(n):
        for t, row in enumerate(gen_idx(a, src)):
            ids_on = [0] * n
            for e in row:
                ids_on[e // le] += 1
            for d in range(n):
                if ids_on[d] == 0:
                    continue
                b["dispatch"][src][d] += 2 * H + 16 + 8 * K
                b["combine"][d][src] += 2 * H
                if t < a.ll_tokens:
                    b["ll_dispatch"][src][d] += 2 * H + 16 + 4 * ids_on[d]
                    b["ll_dispatch_fp8"][src][d] += H + 4 * (H // 128) + 16 + 4 * ids_on[d]
                    b["ll_combine"][d][src] += ids_on[d] * 2 * H
    return b


def pattern(src, dst, size, dev):
    """Bytes src sends dst: values 0..250 that shift with the offset, so a
    chunk landing at the wrong place or from the wrong rank shows."""
    v = torch.arange(size, dtype=torch.int32, device=dev) + (src * 16 + dst * 3)
    return (v % 251).to(torch.uint8)


def sync_ranks(one):
    dist.all_reduce(one)
    torch.cuda.synchronize()


def timed_call(out, inp, send, recv, ev):
    ev[0].record()
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
    ev[1].record()
    ev[1].synchronize()
    return ev[0].elapsed_time(ev[1])


def check_first(op, r, n, out, send, recv, dev):
    """The first call moved what it should: split sizes as every rank sees
    them, and each source's byte pattern in its place."""
    mine = torch.tensor(send, dtype=torch.int64, device=dev)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine)
    if theirs.tolist() != recv:
        raise RuntimeError(f"rank {r} {op}: peers send {theirs.tolist()} bytes, expected {recv}")
    off = 0
    for src in range(n):
        if not torch.equal(out[off:off + recv[src]], pattern(src, r, recv[src], dev)):
            raise RuntimeError(f"rank {r} {op}: bytes from rank {src} wrong or missing")
        off += recv[src]


def rank_main(r, n, a, splits, start_barrier, rdzv, result_dir):
    dev = torch.device("cuda", r)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)  # the CUDA context, outside init_ms
    kw = {}
    if not a.lazy and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kw["device_id"] = dev
    start_barrier.wait()
    t0 = time.perf_counter()
    dist.init_process_group("nccl", init_method=rdzv, rank=r, world_size=n,
                            timeout=timedelta(seconds=120), **kw)
    init_ms = (time.perf_counter() - t0) * 1e3
    one = torch.ones(1, device=dev)
    ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    bufs = {}
    for op in OPS:
        send = splits[op][r]
        recv = [splits[op][s][r] for s in range(n)]
        inp = torch.cat([pattern(r, d, send[d], dev) for d in range(n)])
        out = torch.full((sum(recv),), 255, dtype=torch.uint8, device=dev)
        bufs[op] = (out, inp, send, recv)
    res = {"init": init_ms, "first": {}, "calls": {}, "bytes": {}}
    for op in OPS:  # first calls; a host barrier lines the ranks up without NCCL
        out, inp, send, recv = bufs[op]
        torch.cuda.synchronize()
        start_barrier.wait()
        res["first"][op] = timed_call(out, inp, send, recv, ev)
        check_first(op, r, n, out, send, recv, dev)
        res["bytes"][op] = sum(send)
    for op in OPS:
        out, inp, send, recv = bufs[op]
        for _ in range(a.warmup):
            dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
        ts = []
        for _ in range(a.calls):
            sync_ranks(one)
            ts.append(timed_call(out, inp, send, recv, ev))
        res["calls"][op] = ts
    sync_ranks(one)
    dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{r}.json"), "w") as f:
        json.dump(res, f)


def report(a, n, ranks, raw):
    """One table row per op for world n; raw times to the CSV."""
    init = max(x["init"] for x in ranks)
    if raw:
        raw.write(f"nccl,{n},init_process_group,init,0,{init:.6f}\n")
        for r, x in enumerate(ranks):
            raw.write(f"nccl,{n},init_process_group,init@{r},0,{x['init']:.6f}\n")
    per_rank = " ".join("%.1f" % x["init"] for x in ranks)
    print(f"# world {n}: init_ms per rank: {per_rank}")
    for op in OPS:
        first = max(x["first"][op] for x in ranks)
        calls = [max(x["calls"][op][i] for x in ranks) for i in range(a.calls)]
        if raw:
            raw.write(f"nccl,{n},{op},first,0,{first:.6f}\n")
            raw.writelines(f"nccl,{n},{op},call,{i},{t:.6f}\n" for i, t in enumerate(calls))
            for r, x in enumerate(ranks):
                raw.write(f"nccl,{n},{op},first@{r},0,{x['first'][op]:.6f}\n")
                raw.writelines(f"nccl,{n},{op},call@{r},{i},{t:.6f}\n"
                               for i, t in enumerate(x["calls"][op]))
        s = sorted(calls)
        med, p99 = s[a.calls // 2], s[(a.calls * 99 + 99) // 100 - 1]  # as bench/ep
        mb = sum(x["bytes"][op] for x in ranks) / n / 1e6
        print(f"{n:5d} {op:16s} {mb:9.2f} {mb * n:9.1f} {init:9.1f} {first:9.3f} {med:9.3f}"
              f" {p99:9.3f} {mb / med:9.1f} {first / med:7.2f}x")


def run_world(a, n, raw):
    splits = split_bytes(a, n)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="nccl_a2a.") as d:
        rdzv = "file://" + os.path.join(d, "rendezvous")
        mp.start_processes(rank_main, args=(n, a, splits, ctx.Barrier(n), rdzv, d),
                           nprocs=n, join=True, start_method="spawn")
        ranks = []
        for r in range(n):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    report(a, n, ranks, raw)


def parse_args():
    p = argparse.ArgumentParser(description="NCCL all_to_all_single moving bench/ep's bytes "
                                "per rank, one rank per GPU.")
    p.add_argument("-n", dest="worlds", default="2,4,8", help="world sizes (default 2,4,8)")
    p.add_argument("-c", dest="calls", type=int, default=200, help="timed calls per op (>= 1)")
    p.add_argument("-w", dest="warmup", type=int, default=5, help="untimed calls per op")
    p.add_argument("-t", dest="tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("-l", dest="ll_tokens", type=int, default=128, help="low-latency tokens")
    p.add_argument("-H", dest="hidden", type=int, default=7168, help="hidden size")
    p.add_argument("-e", dest="experts", type=int, default=256, help="experts")
    p.add_argument("-k", dest="topk", type=int, default=8, help="experts per token")
    p.add_argument("-x", dest="seed", type=int, default=42, help="seed (bench/ep's default)")
    p.add_argument("-o", dest="raw", help="append raw times to this CSV")
    p.add_argument("-L", dest="lazy", action="store_true",
                   help="no device_id: the communicator is made at the first call")
    a = p.parse_args()
    if a.calls < 1 or a.warmup < 0 or a.topk > a.experts or a.ll_tokens > a.tokens:
        p.error("need CALLS >= 1, WARMUP >= 0, TOPK <= EXPERTS, LL_TOKENS <= TOKENS")
    return a


def main():
    a = parse_args()
    ngpu = torch.cuda.device_count()
    v = torch.cuda.nccl.version() if ngpu else "none"
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    print(f"# torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {ngpu} GPUs")
    for i in range(ngpu):
        print(f"#   GPU {i}: {torch.cuda.get_device_name(i)}")
    for k in sorted(k for k in os.environ if k.startswith("NCCL_")):
        print(f"#   {k}={os.environ[k]}")
    print(f"# {a.tokens} tokens x {a.hidden} hidden x top-{a.topk} of {a.experts} experts, "
          f"{a.ll_tokens} low-latency tokens, seed {a.seed}; {a.calls} calls (+{a.warmup} warm-up)"
          f"; times: slowest rank; MB/rank and GB/s: mean per rank, MB/call: all ranks"
          f" (as bench/ep), own share included")
    print(f"{'world':>5s} {'op':16s} {'MB/rank':>9s} {'MB/call':>9s} {'init_ms':>9s}"
          f" {'first_ms':>9s} {'med_ms':>9s} {'p99_ms':>9s} {'GB/s':>9s} {'first/med':>8s}")
    raw = None
    if a.raw:
        new = not os.path.exists(a.raw) or os.path.getsize(a.raw) == 0
        raw = open(a.raw, "a")
        if new:
            raw.write("nccl,world,op,kind,index,ms\n")
    failed = 0
    for n in (int(w) for w in a.worlds.split(",") if w):
        if n > ngpu:
            print(f"# world {n}: skipped, only {ngpu} GPUs")
        elif n < 1 or a.experts % n:
            print(f"# world {n}: skipped, {a.experts} experts do not divide over {n} ranks")
        else:
            try:
                run_world(a, n, raw)
            except Exception as e:  # one world failing must not hide the others
                print(f"# world {n}: FAILED: {e}", flush=True)
                failed += 1
        sys.stdout.flush()
    if raw:
        raw.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
