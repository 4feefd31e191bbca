"""The rank processes of test_elastic.py: an elastic job (deepep.Buffer(elastic=True), and
deep_ep.Buffer(enable_shrink=True) on the odd ranks of the eager job) whose ranks run the
phases of PHASES, each started by the test through a torch.distributed TCPStore it hosts (the
trainer's own store of docs/operating.md, "Elastic jobs"), while the test SIGKILLs ranks
between phases and starts replacements.

A round is a throughput pair (dispatch, the experts' x (rank + 1), combine) and a low-latency
pair (dispatch bf16, the experts' x expert_scale, combine), of the inputs of ranks.inputs.  In
the graph job (cuda only) the low-latency pair is one torch.cuda.CUDAGraph, captured before
any call, whose inputs each round copies into the captured tensors before it replays it.

Each rank pickles what every phase saw into outdir/<rank>.<phase>.pkl, or the exception into
outdir/err.<rank>.<first phase>.txt (and exits 1), for the test to hold to numpy's reference.
"""
import datetime
import os
import pickle
import traceback
from typing import Dict, List

import numpy as np
import torch

import ranks

WORLD = 4
#: The phases of a job: the ranks masked in its rounds ("k1", "k2": the ranks the test kills,
#: named so by it) and, for "rejoin", the rank whose replacement starts at the phase: the
#: survivors line up with its join call (docs/operating.md's recipe), then every rank runs the
#: rounds.  The test kills k1 after phase 0 and k2 after phase 1, between calls (every rank
#: has ended its calls of the phase and waits for the next one's start).
PHASES = (
    dict(kind="rounds", masked=(), rounds=2),
    dict(kind="rounds", masked=("k1",), rounds=2),
    dict(kind="rounds", masked=("k1", "k2"), rounds=2),
    dict(kind="rejoin", watch="k1", masked=("k2",), rounds=2),
    dict(kind="rejoin", watch="k2", masked=(), rounds=2),
)
#: Communicating calls per replay of the graph job's graph (low_latency_dispatch and
#: low_latency_combine), as the kernels count them on the device at each replay.
GRAPH_CALLS = 2
#: Generous ceiling for any one wait of a rank or of the test: a phase's start, a replacement's
#: join call, a survivor seeing a mask.  The ranks start (torch imports) and run a phase in
#: seconds when the machine is idle; this is for a loaded 2-core CI machine, not a timing.
CEILING_S = 300


def phase_masked(p: int, k1: int, k2: int) -> List[int]:
    """The ranks masked in phase p's rounds."""
    return sorted({"k1": k1, "k2": k2}[n] for n in PHASES[p]["masked"])


def it_of(p: int, i: int, graph: bool) -> Dict[str, int]:
    """The inputs' iterations (ranks.inputs) of round i of phase p: the throughput pair's and
    the low-latency pair's (even in the graph job: full batches, a graph has one token
    count)."""
    it = 100 * p + i
    return dict(tp=it, ll=2 * it if graph else it)


def _store(port: int):
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=CEILING_S))


def _wait(store, key: str) -> None:
    store.wait([key], datetime.timedelta(seconds=CEILING_S))


def elastic_rank(rank: int, first: int, cfg: dict) -> None:
    """Process `rank` of the job cfg describes, from phase `first` (a replacement: the
    rejoin phase for its rank); exits 0 when the test ends the job, 1 on any failure."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "DEEPEP_JOB_ID", "SLURM_PROCID", "SLURM_JOB_ID"):
        os.environ.pop(name, None)
    try:
        _Rank(rank, first, cfg).run()
    except BaseException:  # said to the test, with the rank and the phase it started at
        path = os.path.join(cfg["outdir"], f"err.{rank}.{first}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(traceback.format_exc())
        os.rename(path + ".tmp", path)
        os._exit(1)
    os._exit(0)


class _Rank:
    def __init__(self, rank: int, first: int, cfg: dict):
        self.rank, self.first, self.cfg = rank, first, cfg
        self.replacement = first > 0
        self.graph = cfg["graph"]
        self.W, self.seed = WORLD, cfg["seed"]
        self.s = ranks.shape(WORLD)
        self.E, self.M = self.s["num_experts"], self.s["max_ll_tokens_per_rank"]
        self.L = self.E // WORLD
        self.dev = torch.device(cfg["device"])
        #: The communicating calls this process ran eagerly and the graph replays it made:
        #: with the first call's number, the call its next one is, as the kernels count
        #: (true_next), whatever next_call() says.
        self.eager = 0
        self.replays = 0
        self.base = 1

    def true_next(self) -> int:
        return self.base + self.eager + GRAPH_CALLS * self.replays

    def run(self) -> None:
        import deepep
        self.deepep = deepep
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
        store = _store(self.cfg["port"])
        kw = dict(job_id=self.cfg["job"], rank=self.rank, world_size=WORLD, local_rank=self.rank,
                  local_world_size=WORLD, socket=self.cfg["sock"], **self.s)
        # The odd ranks of the eager job are deep_ep's, whose enable_shrink is elastic: every
        # rank passes the same flag either way, and low_latency_query_mask_buffer is theirs.
        self.compat = not self.graph and self.rank % 2 == 1
        if self.compat:
            deep_ep = ranks.import_compat()
            b = deep_ep.Buffer(explicitly_destroy=True, enable_shrink=True, **kw)
        else:
            b = deepep.Buffer(elastic=True, **kw)
        self.b = b
        at_attach = {}
        if self.replacement:
            # Its first call is the join call J the daemon chose: said to the survivors through
            # the store, as a trainer would.
            self.base = b.next_call()
            at_attach = dict(join=self.base, mask=self.masks())
            store.set(f"join/{self.rank}", str(self.base))
        if self.graph:
            self.capture()
        for p in range(self.first, len(PHASES)):
            _wait(store, f"go/{p}")
            out = self.phase(store, p)
            if p == self.first:
                out["at_attach"] = at_attach
            path = os.path.join(self.cfg["outdir"], f"{self.rank}.{p}.pkl")
            with open(path + ".tmp", "wb") as f:
                pickle.dump(out, f)
            os.rename(path + ".tmp", path)
            store.add(f"done/{p}", 1)
        _wait(store, "go/end")
        if self.graph:
            del self.g
        b.destroy()

    def masks(self) -> dict:
        """What the rank's mask calls say now: mask() (list, epoch) and, on deep_ep's ranks,
        low_latency_query_mask_buffer."""
        m, epoch = self.b.mask()
        out = dict(mask=m.tolist(), epoch=epoch, dtype=str(m.dtype))
        if self.compat:
            status = torch.full((WORLD,), 7, dtype=torch.int32)
            self.b.low_latency_query_mask_buffer(status)
            out["query"] = status.tolist()
        return out

    def phase(self, store, p: int) -> dict:
        ph = PHASES[p]
        cfg = self.cfg
        masked = phase_masked(p, cfg["k1"], cfg["k2"])
        out: dict = dict(rank=self.rank, replacement=self.replacement, masked=masked,
                         next_call_before=self.b.next_call(), true_next_before=self.true_next())
        if ph["kind"] == "rejoin" and not (self.replacement and p == self.first):
            out["rejoin"] = self.line_up(store, cfg[ph["watch"]])
        out["rounds"] = [self.round(p, i) for i in range(ph["rounds"])]
        out["after"] = self.masks()
        out.update(next_call_after=self.b.next_call(), true_next_after=self.true_next())
        return out

    def line_up(self, store, q: int) -> dict:
        """docs/operating.md's rejoin recipe on a survivor: J from the replacement of rank q
        through the store, then J - n calls with q still masked (throughput dispatches of no
        tokens), n being this rank's next call as the kernels count it (true_next: on cuda
        next_call() does not count a graph's replays, and counts its captured calls once, at
        the capture)."""
        _wait(store, f"join/{q}")
        join = int(store.get(f"join/{q}"))
        n = self.true_next()
        out = dict(join=join, next_call=self.b.next_call(), true_next=n)
        if n > join:
            raise RuntimeError(f"rank {self.rank}: at call {n}, past rank {q}'s replacement's "
                               f"first call {join}")
        h = self.s["hidden"]
        x = torch.zeros((0, h), dtype=torch.bfloat16, device=self.dev)
        idx = torch.zeros((0, self.s["num_topk"]), dtype=torch.int64, device=self.dev)
        w = torch.zeros((0, self.s["num_topk"]), dtype=torch.float32, device=self.dev)
        for _ in range(join - n):
            self.b.dispatch(x, topk_idx=idx, topk_weights=w)
            self.eager += 1
        out.update(padded=join - n, next_call_at_join=self.b.next_call(),
                   true_next_at_join=self.true_next(), mask_at_join=self.masks())
        return out

    def dropped(self, handle):
        """dropped(handle), or where the backend does not count (cuda) what it raised:
        ("raised", the exception's class, its DEP_ERR_ name where it has one)."""
        try:
            return self.b.dropped(handle)
        except (self.deepep.Unsupported, self.deepep.Error) as e:
            if isinstance(e, self.deepep.Error) and e.name != "DEP_ERR_UNSUPPORTED":
                raise
            return ("raised", type(e).__name__, getattr(e, "name", ""))

    def round(self, p: int, i: int) -> dict:
        its = it_of(p, i, self.graph)
        b, dev, r = self.b, self.dev, self.rank
        inp = ranks.inputs(self.seed, r, WORLD, its["tp"])
        x = torch.from_numpy(inp["x"]).bfloat16().to(dev)
        idx = torch.from_numpy(inp["idx"]).to(dev)
        w = torch.from_numpy(inp["w"]).to(dev)
        rx, ri, rw, counts, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
        self.eager += 1
        res = dict(it=its, recv_x=ranks.bits(rx), recv_idx=ri.cpu().numpy(),
                   recv_w=rw.cpu().numpy(), counts=np.array(counts, np.int64),
                   tp_dropped=self.dropped(h))
        comb, _, _ = b.combine((rx.float() * (r + 1)).bfloat16(), h)
        self.eager += 1
        res["combined"] = ranks.bits(comb)
        li = ranks.inputs(self.seed, r, WORLD, its["ll"], ll=True)
        if self.graph:
            self.load(li)
            self.g.replay()
            self.replays += 1
            torch.cuda.synchronize()
            recv, count, lout, ll_dropped = self.g_recv, self.g_count, self.g_out, "graph"
        else:
            lx = torch.from_numpy(li["x"]).bfloat16().to(dev)
            lidx = torch.from_numpy(li["idx"]).to(dev)
            lw = torch.from_numpy(li["w"]).to(dev)
            recv, count, lh, _, _ = b.low_latency_dispatch(lx, lidx, self.M, self.E,
                                                            use_fp8=False)
            self.eager += 1
            ll_dropped = self.dropped(lh)
            lout, _, _ = b.low_latency_combine((recv.float() * self.scale()).bfloat16(), lidx,
                                               lw, lh)
            self.eager += 1
        res.update(ll_x=ranks.bits(recv), ll_count=count.cpu().numpy(),
                   ll_combined=ranks.bits(lout), ll_dropped=ll_dropped)
        return res

    def scale(self) -> torch.Tensor:
        L, r = self.L, self.rank
        return torch.from_numpy(ranks.expert_scale(WORLD)[r * L:(r + 1) * L]).view(L, 1, 1) \
            .to(self.dev)

    # ---- the graph job ----------------------------------------------------------------

    def capture(self) -> None:
        """The low-latency pair captured in a CUDA graph with no call of the Buffer before it
        (ranks.graph_layers_rank): nothing runs at the capture, so a replacement's first call
        is still its join call, and a survivor's replays are the calls the kernels count."""
        s, dev = self.s, self.dev
        self.sx = torch.zeros(self.M, s["hidden"], dtype=torch.bfloat16, device=dev)
        self.sidx = torch.full((self.M, s["num_topk"]), -1, dtype=torch.int64, device=dev)
        self.sw = torch.zeros(self.M, s["num_topk"], dtype=torch.float32, device=dev)
        self.g_out = torch.empty_like(self.sx)
        # Kept as long as the graph: a replay reads the captured tensors at their addresses,
        # and torch's allocator hands a dropped tensor's memory to the next tensor made (a
        # round's throughput call makes several), whose contents a replay would read as the
        # experts' scales.
        scale = self.g_scale = self.scale()
        # torch's own kernels once outside the capture (torch's rule); no deepep call before.
        ((torch.zeros(self.L, 1, s["hidden"], device=dev).float() * scale).bfloat16())
        torch.cuda.synchronize()
        self.g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g):
            recv, count, h, _, _ = self.b.low_latency_dispatch(self.sx, self.sidx, self.M,
                                                                self.E, use_fp8=False)
            self.b.low_latency_combine((recv.float() * scale).bfloat16(), self.sidx, self.sw,
                                       h, out=self.g_out)
        self.g_recv, self.g_count = recv, count

    def load(self, li: dict) -> None:
        """New inputs copied into the captured tensors (a graph has one token count)."""
        assert li["idx"].shape[0] == self.M
        self.sx.copy_(torch.from_numpy(li["x"]).bfloat16())
        self.sidx.copy_(torch.from_numpy(li["idx"]))
        self.sw.copy_(torch.from_numpy(li["w"]))
