"""Elastic jobs end to end through the binding (docs/operating.md "Elastic jobs", deepep.h
"Masked ranks" and dep_next_call, DESIGN §14): a job of 4 rank processes on the session's
daemon, deepep.Buffer(elastic=True) (and deep_ep.Buffer(enable_shrink=True) on the odd ranks),
each round's calls of both modes (bf16) held to numpy's reference; one rank SIGKILLed between
calls, the survivors' next calls held to the reference with it masked (its experts'
contributions zero, its tokens absent), mask() and low_latency_query_mask_buffer reporting it,
dropped() counting the pairs; a second rank killed the same way; a replacement for the first
attaching with its id, from whose join call the job matches the reference with only the
second masked; then one for the second, and the full reference on every rank.  The survivors
never re-create their Buffer.  On cuda the same again with the low-latency pair captured in a
CUDA graph before the first kill and replayed across every epoch change (elasticranks.py).

Nothing waits unbounded: the test's waits and the ranks' have elasticranks.CEILING_S.
"""
import datetime
import multiprocessing as mp
import os
import pickle
import random
import signal
import time
import uuid

import numpy as np
import pytest

import conftest
import elasticranks
from deepep import _lib
import ranks
from elasticranks import CEILING_S, PHASES, WORLD, it_of, phase_masked
from test_ops import bf16_bits, bf16_round, ll_rows, owner

SHAPE = ranks.shape(WORLD)
L = SHAPE["num_experts"] // WORLD
#: How far past the newest call the survivors have posted the daemon puts a replacement's join
#: call (docs/operating.md, "Elastic jobs": 8 calls).
JOIN_AHEAD = 8


class _Failed(Exception):
    """A phase of the job failed (or outlived the ceiling): args (phase, what)."""


def _run_job(daemon: str, seed: int, d: str, graph: bool) -> dict:
    """The job of elasticranks.PHASES: ranks started, killed and replaced by the phases, each
    phase's start through the store; {"k1", "k2", "graph", (rank, phase): what that rank saw,
    "failed": None, or (the first phase not complete, why)}: the phases before a failure are
    still held to the reference, each test failing with the why where it needs a later one."""
    import torch.distributed as dist
    rng = random.Random(seed * 2 + int(graph))
    k1 = rng.randrange(WORLD)
    k2 = rng.choice([r for r in range(WORLD) if r != k1])
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=CEILING_S),
                          wait_for_workers=False)
    cfg = dict(sock=daemon, job=f"el-py-{'g' if graph else 'e'}-{uuid.uuid4().hex[:8]}",
               seed=seed, port=store.port, outdir=d, k1=k1, k2=k2, graph=graph,
               device=conftest.DEVICE)
    ctx = mp.get_context("spawn")
    procs, killed, status = {}, set(), {}

    def start(r: int, first: int) -> None:
        p = ctx.Process(target=elasticranks.elastic_rank, args=(r, first, cfg))
        p.start()
        procs[(r, first)] = p

    def failures() -> str:
        out = []
        for (r, first), p in procs.items():
            if (r, first) not in killed and p.exitcode not in (None, 0):
                path = os.path.join(d, f"err.{r}.{first}.txt")
                why = open(path).read() if os.path.exists(path) else \
                    f"exit code {p.exitcode}, no error written"
                out.append(f"rank {r} (from phase {first}):\n{why}")
        return "\n".join(out)

    def await_ranks(p: int, n: int) -> None:
        deadline = time.monotonic() + CEILING_S
        while store.add(f"done/{p}", 0) < n:
            f = failures()
            if f:
                raise _Failed(p, f"phase {p} (k1 {k1}, k2 {k2}, seed {seed}):\n{f}")
            if time.monotonic() > deadline:
                raise _Failed(p, f"phase {p}: {store.add(f'done/{p}', 0)} of {n} ranks ended "
                              f"it within {CEILING_S} s (k1 {k1}, k2 {k2}, seed {seed})")
            time.sleep(0.01)  # a poll of the ranks' counters, bounded above

    def job_status(st) -> dict:
        for i in range(st.num_jobs):
            j = st.jobs[i]
            if j.job_id.decode() == cfg["job"]:
                return dict(attached=j.ranks_attached, flags=j.flags, masked=j.masked,
                            epoch=j.epoch, mask=j.mask.decode())
        return {}

    def await_done(p: int, n: int) -> None:
        await_ranks(p, n)
        # What dep_status (deepepctl status) says of the job once every live rank ended p.
        status[p] = conftest.daemon_status(daemon, job_status)

    def kill(r: int) -> None:
        # Between calls: every rank has ended phase p's calls and waits for the next start.
        p = procs[(r, 0)]
        os.kill(p.pid, signal.SIGKILL)
        p.join(CEILING_S)
        killed.add((r, 0))

    failed = None
    try:
        for r in range(WORLD):
            start(r, 0)
        store.set("go/0", "1")
        await_done(0, WORLD)
        kill(k1)
        store.set("go/1", "1")
        await_done(1, WORLD - 1)
        kill(k2)
        store.set("go/2", "1")
        await_done(2, WORLD - 2)
        start(k1, 3)
        store.set("go/3", "1")
        await_done(3, WORLD - 1)
        start(k2, 4)
        store.set("go/4", "1")
        await_done(4, WORLD)
        store.set("go/end", "1")
        for key, p in procs.items():
            if key not in killed:
                p.join(CEILING_S)
        f = failures()
        if f:
            raise _Failed(len(PHASES), f"at the job's end:\n{f}")
        alive = [key for key, p in procs.items() if p.is_alive()]
        if alive:
            raise _Failed(len(PHASES), f"ranks {alive} did not exit within {CEILING_S} s of "
                          "the job's end")
    except _Failed as e:
        failed = e.args
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
    out = dict(k1=k1, k2=k2, graph=graph, failed=failed, status=status, job=cfg["job"])
    for p in range(len(PHASES)):
        for r in range(WORLD):
            path = os.path.join(d, f"{r}.{p}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    out[(r, p)] = pickle.load(f)
    return out


@pytest.fixture(scope="module")
def eager(daemon, seed, tmp_path_factory):
    return _run_job(daemon, seed, str(tmp_path_factory.mktemp("elastic")), graph=False)


@pytest.fixture(scope="module")
def graph(daemon, seed, tmp_path_factory):
    if conftest.BACKEND != "cuda":
        pytest.skip("the graph job needs torch CUDA graphs: the cuda backend "
                    "(DEP_TEST_BACKEND=cuda on a machine with a GPU); this run is on the host "
                    "backend")
    return _run_job(daemon, seed, str(tmp_path_factory.mktemp("elastic-graph")), graph=True)


# ---- the reference: test_ops's, with the masked ranks' experts and tokens removed ---------

def _inputs(seed: int, it: int, ll: bool) -> list:
    return [ranks.inputs(seed, s, WORLD, it, ll) for s in range(WORLD)]


def check_dispatch(got: dict, r: int, inps: list, masked: list) -> None:
    """Rank r received each token of every live source with an expert on r, once, in source
    order: nothing from a masked source."""
    xs, ids, ws = [], [], []
    for s, inp in enumerate(inps):
        if s in masked:
            continue
        o = owner(inp["idx"], L)
        for t in range(len(o)):
            if (o[t] == r).any():
                xs.append(inp["x"][t])
                ids.append(np.where(o[t] == r, inp["idx"][t] - r * L, -1))
                ws.append(np.where(o[t] == r, inp["w"][t], 0))
    n = len(xs)
    assert got["recv_x"].shape == (n, SHAPE["hidden"])
    if n:
        np.testing.assert_array_equal(got["recv_x"], bf16_bits(np.stack(xs)))
        np.testing.assert_array_equal(got["recv_idx"], np.stack(ids))
        np.testing.assert_array_equal(got["recv_w"], np.stack(ws).astype(np.float32))
    assert list(got["counts"]) == [int((np.stack(ids) == l).sum()) if n else 0
                                   for l in range(L)]


def check_combine(got: dict, inp: dict, masked: list) -> None:
    """Each live rank q's experts returned x * (q + 1): a token gets x * the sum over the live
    ranks it went to; a masked rank's contribution is zero."""
    o = owner(inp["idx"], L)
    factor = np.array([sum(q + 1 for q in range(WORLD) if q not in masked and (o[t] == q).any())
                       for t in range(len(o))], np.float32)
    # A float32 sum starts at +0: a token no live rank received is +0, not x * 0.
    want = bf16_bits(inp["x"] * factor[:, None] + np.float32(0)) if len(o) else \
        np.zeros((0, SHAPE["hidden"]), np.int16)
    np.testing.assert_array_equal(got["combined"], want)


def check_ll_dispatch(got: dict, r: int, inps: list, masked: list) -> None:
    rows = WORLD * SHAPE["max_ll_tokens_per_rank"]
    assert got["ll_x"].shape == (L, rows, SHAPE["hidden"])
    live = [inp for s, inp in enumerate(inps) if s not in masked]
    for l in range(L):
        want = ll_rows(live, r * L + l)
        assert got["ll_count"][l] == len(want), (l, got["ll_count"], len(want))
        if want:
            np.testing.assert_array_equal(got["ll_x"][l, :len(want)], bf16_bits(np.stack(want)))


def check_ll_combine(got: dict, inp: dict, masked: list) -> None:
    scale = ranks.expert_scale(WORLD)
    x, idx, w = inp["x"], inp["idx"], inp["w"]
    acc = np.zeros_like(x)
    for k in range(idx.shape[1]):
        sel = (idx[:, k] >= 0) & ~np.isin(owner(idx[:, k], L), masked)
        y = bf16_round(x * scale[np.maximum(idx[:, k], 0)][:, None])
        acc += np.where(sel[:, None], w[:, k:k + 1] * y, 0).astype(np.float32)
    np.testing.assert_array_equal(got["ll_combined"], bf16_bits(acc))


def dropped_pairs(inp: dict, masked: list) -> int:
    """The (token, k) pairs of inp whose expert is on a masked rank."""
    return int(np.isin(owner(inp["idx"], L), masked).sum())


def check_round(got: dict, r: int, seed: int, masked: list, graph: bool) -> None:
    its = got["it"]
    assert its == it_of(got["phase"], got["i"], graph)
    tp, ll = _inputs(seed, its["tp"], False), _inputs(seed, its["ll"], True)
    check_dispatch(got, r, tp, masked)
    check_combine(got, tp[r], masked)
    check_ll_dispatch(got, r, ll, masked)
    check_ll_combine(got, ll[r], masked)
    if conftest.BACKEND == "cuda":
        # The cuda kernels do not count the pairs they drop: dropped() raises (which class:
        # test_dropped_raises_deepep_unsupported_on_cuda).
        raised = (("raised", "Unsupported", ""), ("raised", "Error", "DEP_ERR_UNSUPPORTED"))
        assert got["tp_dropped"] in raised
        assert got["ll_dropped"] == "graph" if graph else got["ll_dropped"] in raised
    else:
        assert got["tp_dropped"] == dropped_pairs(tp[r], masked)
        assert got["ll_dropped"] == dropped_pairs(ll[r], masked)


def _phases(job: dict, phases=range(len(PHASES))):
    """(rank, phase, what the rank saw, the phase's masked ranks) of every rank live in each
    of phases: the ranks not masked in it, each of which wrote its results."""
    for p in phases:
        if job["failed"] is not None and p >= job["failed"][0]:
            pytest.fail(job["failed"][1])
        masked = phase_masked(p, job["k1"], job["k2"])
        live = [r for r in range(WORLD) if (r, p) in job]
        assert live == [r for r in range(WORLD) if r not in masked], (p, live, masked)
        for r in live:
            assert job[(r, p)]["masked"] == masked
            yield r, p, job[(r, p)], masked


def _rounds(job: dict, phases):
    for r, p, o, masked in _phases(job, phases):
        for i, got in enumerate(o["rounds"]):
            yield r, p, i, dict(got, phase=p, i=i), masked


def _check_masks(job: dict, phases) -> None:
    for r, p, o, masked in _phases(job, phases):
        want = [int(q in masked) for q in range(WORLD)]
        a = o["after"]
        assert a["mask"] == want and a["dtype"] == "torch.int32", (r, p, a, masked)
        if "query" in a:  # deep_ep's ranks: DeepEP's call reports the same
            assert a["query"] == want, (r, p, a)


# ---- the tests ---------------------------------------------------------------------------

@pytest.fixture(params=["eager", "graph"], ids=["eager", "graph"])
def job(request):
    """Every rank's results of the eager job, or of the graph job (cuda only)."""
    return request.getfixturevalue(request.param)


def test_every_phase_ends_and_every_rank_exits_within_the_ceiling(job):
    assert job["failed"] is None, job["failed"][1]


def test_every_rank_matches_the_reference_before_any_rank_is_killed(job, seed):
    for r, p, i, got, masked in _rounds(job, [0]):
        check_round(got, r, seed, masked, job["graph"])


def test_the_survivors_next_calls_after_a_kill_match_the_reference_with_it_masked(job, seed):
    seen = set()
    for r, p, i, got, masked in _rounds(job, [1, 2]):
        assert masked == sorted([job["k1"]] + ([job["k2"]] if p == 2 else []))
        check_round(got, r, seed, masked, job["graph"])
        seen.add((p, r))
    assert len(seen) == (WORLD - 1) + (WORLD - 2)


def test_mask_and_the_query_report_the_killed_ranks_with_an_epoch_that_grows(job):
    # The graph job's survivors after a rejoin: test_the_mask_after_a_rejoin_in_the_graph_job.
    _check_masks(job, range(len(PHASES)) if not job["graph"] else [0, 1, 2])
    epochs = {}
    for r, p, o, masked in _phases(job):
        epochs.setdefault(p, set()).add(o["after"]["epoch"])
    # The daemon writes the same epoch into every survivor's slab (the sum of the counts of
    # leaves and returns), and a new one at each kill and each rejoin.
    assert all(len(e) == 1 for e in epochs.values()), epochs
    e = [epochs[p].pop() for p in range(len(PHASES))]
    assert e[0] == 0 and e[0] < e[1] < e[2] < e[3] < e[4], e


def test_a_replacement_joins_at_its_join_call_and_the_job_matches_the_reference_again(job,
                                                                                       seed):
    for p, watch in ((3, job["k1"]), (4, job["k2"])):
        list(_phases(job, [p]))  # fails with the job's failure where phase p did not complete
        rep = job[(watch, p)]
        assert rep["replacement"] and "at_attach" in rep and "rejoin" not in rep
        J = rep["at_attach"]["join"]
        assert J > 1 and rep["true_next_before"] == J
        lined_up = 0
        for r, o in ((r, job.get((r, p))) for r in range(WORLD) if r != watch):
            if o is None:
                continue
            # Every survivor waited at the same call n, the daemon put J JOIN_AHEAD calls past
            # the newest they had posted (n - 1: in the graph job, replays included), and each
            # made J - n calls to reach it.
            lu = o["rejoin"]
            assert lu["join"] == J and lu["true_next"] - 1 + JOIN_AHEAD == J, (r, p, lu)
            assert lu["padded"] == J - lu["true_next"]
            lined_up += 1
        assert lined_up == (WORLD - 2 if p == 3 else WORLD - 1)
    for r, p, i, got, masked in _rounds(job, [3, 4]):
        assert masked == ([job["k2"]] if p == 3 else [])
        check_round(got, r, seed, masked, job["graph"])


def _ranges(ranks_: list) -> str:
    """deepepctl's text of a set of ranks: "3,5-7"."""
    out, i = [], 0
    while i < len(ranks_):
        j = i
        while j + 1 < len(ranks_) and ranks_[j + 1] == ranks_[j] + 1:
            j += 1
        out.append(str(ranks_[i]) if i == j else f"{ranks_[i]}-{ranks_[j]}")
        i = j + 1
    return ",".join(out)


def test_the_daemons_status_shows_each_phases_epoch_and_masked_ranks(job):
    for r, p, o, masked in _phases(job):
        st = job["status"][p]
        assert st, f"phase {p}: dep_status lists no job {job['job']}"
        assert st == dict(attached=WORLD - len(masked), flags=_lib.ATTACH_ELASTIC, masked=len(masked),
                          epoch=o["after"]["epoch"], mask=_ranges(masked)), (p, st, masked)


def test_next_call_counts_every_call_on_every_rank_of_the_eager_job(eager):
    """next_call() is the number of the rank's next call on both backends where every call
    runs eagerly: the survivors line up by it, and a replacement's is its join call."""
    for r, p, o, masked in _phases(eager):
        assert o["next_call_before"] == o["true_next_before"], (r, p, o["next_call_before"])
        assert o["next_call_after"] == o["true_next_after"], (r, p, o["next_call_after"])
        if "rejoin" in o:
            lu = o["rejoin"]
            assert lu["next_call"] == lu["true_next"]
            assert lu["next_call_at_join"] == lu["join"]


# ---- the join call, graph replays and dropped() on cuda ------------------------------------

def test_at_the_join_call_the_query_shows_the_replacement_live(eager):
    """deepep.h: dep_mask_query says "what the next call will use".  When the next call is
    the join call J, that is the rank live: on every survivor once it has lined up (its
    next_call() is J), and on the replacement after its attach (whose next_call() is J)."""
    for p, watch in ((3, eager["k1"]), (4, eager["k2"])):
        list(_phases(eager, [p]))  # fails with the job's failure where phase p did not complete
        want = [int(q in phase_masked(p, eager["k1"], eager["k2"])) for q in range(WORLD)]
        got = {watch: eager[(watch, p)]["at_attach"]["mask"]["mask"]}
        for r, o, _ in ((r, eager.get((r, p)), 0) for r in range(WORLD) if r != watch):
            if o is not None:
                got[r] = o["rejoin"]["mask_at_join"]["mask"]
        assert all(m == want for m in got.values()), (p, watch, want, got)


def test_next_call_counts_a_replayed_graphs_calls(graph):
    for r, p, o, masked in _phases(graph):
        assert o["next_call_after"] == o["true_next_after"], (r, p, o["next_call_after"],
                                                              o["true_next_after"])
        if "rejoin" in o:
            assert o["rejoin"]["next_call"] == o["rejoin"]["true_next"], (r, p, o["rejoin"])


def test_the_mask_after_a_rejoin_in_the_graph_job(graph):
    _check_masks(graph, [3, 4])


def test_dropped_raises_deepep_unsupported_on_cuda(eager):
    if conftest.BACKEND != "cuda":
        pytest.skip("dropped() counts on the host backend (the other tests check its counts)")
    for r, p, i, got, masked in _rounds(eager, range(len(PHASES))):
        assert got["tp_dropped"] == ("raised", "Unsupported", "")
        assert got["ll_dropped"] == ("raised", "Unsupported", "")
