"""deep_ep.utils as DeepEP 2.x has it (issue 26): the helpers its tests/legacy/ scripts import
(deep_ep.utils.envs, .math, .testing), each held to a case whose answer is stated by hand,
init_dist in a real two-process gloo group, and the scripts' own import lines in a fresh
interpreter that finds deep_ep as an opt-in install lays it out."""
import os
import pickle
import subprocess
import sys
import tempfile

import pytest
import torch

import conftest
import ranks

ranks.import_compat()
from deep_ep.utils import envs, testing  # noqa: E402
from deep_ep.utils import math as dmath  # noqa: E402

#: The lines DeepEP 2.x's tests/legacy/ scripts import deep_ep.utils with (test_internode.py's
#: math line is the longest; test_low_latency.py adds bench_kineto).
LEGACY_IMPORTS = (
    "from deep_ep.utils.envs import init_dist\n"
    "from deep_ep.utils.math import calc_diff, create_grouped_scores, inplace_unique, "
    "per_token_cast_to_fp8, per_token_cast_back, hash_tensor\n"
    "from deep_ep.utils.testing import bench, bench_kineto\n"
    "from deep_ep.utils import EventHandle, EventOverlap\n")

#: Generous ceiling for two spawned ranks that import torch on a loaded 2-core machine; they
#: finish in seconds when it is idle.
_SPAWN_TIMEOUT = 180


def _bytes(q: torch.Tensor) -> list:
    """FP8 values as their e4m3 bytes, whichever dtype this torch gives them."""
    return q.view(torch.uint8).flatten().tolist()


# ---- deep_ep.utils.math ------------------------------------------------------------------

def test_calc_diff_is_zero_for_equal_tensors_and_the_formula_on_a_small_case():
    x = torch.randn(3, 5)
    assert dmath.calc_diff(x, x.clone()) == 0
    # a = x + 1 = [2, 1], b = y + 1 = [2, 3]: 1 - 2 (4 + 3) / (4 + 1 + 4 + 9) = 4 / 18.
    got = dmath.calc_diff(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 2.0]))
    assert isinstance(got, float) and got == pytest.approx(2 / 9, rel=1e-12)


def test_align_ceil_div_and_count_bytes():
    assert (dmath.align(200, 128), dmath.align(256, 128), dmath.align(0, 128)) == (256, 256, 0)
    assert dmath.ceil_div(7, 2) == 4 and dmath.ceil_div(8, 2) == 4
    # 2 x 3 float32 (24 bytes), None, and a nested list holding 4 int64 (32 bytes).
    assert dmath.count_bytes(torch.zeros(2, 3), None, [torch.zeros(4, dtype=torch.int64)]) == 56


def test_hash_tensor_sums_int32_words_or_bytes_and_hash_tensors_xors():
    assert dmath.hash_tensor(torch.tensor([1, 2, -3], dtype=torch.int32)) == 0
    assert dmath.hash_tensor(torch.tensor([1.0])) == 0x3F800000  # float32 1.0's bits
    # bf16 1.0 is bytes 0x80 0x3f: 3 * (128 + 63).
    assert dmath.hash_tensor(torch.ones(3, dtype=torch.bfloat16)) == 573
    assert dmath.hash_tensor(torch.tensor([1], dtype=torch.int64)) == 1  # bytes 1, 0 x 7
    t = torch.arange(6, dtype=torch.int32).view(2, 3)
    assert dmath.hash_tensor(t.T) == 15  # read contiguous, any strides
    five, three = torch.tensor([5], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    assert dmath.hash_tensors(five, [None, three], "skipped") == 5 ^ 3


def test_inplace_unique_leaves_each_rows_distinct_values_descending_then_minus_one():
    x = torch.tensor([[3, 1, 3, -1], [2, 2, 2, 2], [-1, -1, -1, -1], [0, 1, 2, 3]])
    assert dmath.inplace_unique(x, 4) is None
    assert x.tolist() == [[3, 1, -1, -1], [2, -1, -1, -1], [-1, -1, -1, -1], [3, 2, 1, 0]]
    narrow = torch.tensor([[0, 3], [1, 1]])
    dmath.inplace_unique(narrow, 4)
    assert narrow.tolist() == [[3, 0], [1, -1]]
    # No more than num_slots columns can hold a value.
    wide = torch.tensor([[1, 0, 1]])
    dmath.inplace_unique(wide, 2)
    assert wide.tolist() == [[1, 0, -1]]
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        dmath.inplace_unique(torch.tensor([[4, 0]]), 4)


def test_create_grouped_scores_zeroes_the_experts_outside_the_chosen_groups():
    scores = torch.tensor([[1.0, 2, 3, 4, 5, 6], [6.0, 5, 4, 3, 2, 1]])
    # Three groups of two experts; token 0 chose groups 2 and 0, token 1 group 1 (twice).
    got = dmath.create_grouped_scores(scores, torch.tensor([[2, 0], [1, 1]]), 3)
    assert got.tolist() == [[1, 2, 0, 0, 5, 6], [0, 0, 4, 3, 0, 0]]
    with pytest.raises(ValueError, match="equal groups"):
        dmath.create_grouped_scores(scores, torch.tensor([[0], [0]]), 4)


def test_per_token_cast_to_fp8_scales_each_128_channels_by_their_amax():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([448.0, -448.0, 1.0, 0.5])
    x[0, 128:] = 2.0
    q, s = dmath.per_token_cast_to_fp8(x)
    assert q.dtype == getattr(torch, "float8_e4m3fn", torch.uint8) and q.shape == (2, 256)
    assert s.dtype == torch.float32 and s.shape == (2, 2)
    # Scales amax / 448; an all-zero group's amax is DeepEP's floor, 1e-4.
    floor = torch.tensor(1e-4, dtype=torch.float32) / 448
    assert s.tolist() == [[1.0, (torch.tensor(2.0) / 448).item()], [floor.item()] * 2]
    # e4m3 bytes: 448 = 1.75 * 2**8 is 0x7e, 1.0 0x38, 0.5 0x30, the sign 0x80; group 1's 2.0
    # is 448 after its scale.
    want = [0x7E, 0xFE, 0x38, 0x30] + [0] * 124 + [0x7E] * 128 + [0] * 256
    assert _bytes(q) == want


def test_per_token_cast_pads_a_hidden_size_that_is_not_a_multiple_of_128():
    x = torch.ones(3, 200, dtype=torch.bfloat16)
    q, s = dmath.per_token_cast_to_fp8(x)
    assert q.shape == (3, 200) and s.shape == (3, 2)
    back = dmath.per_token_cast_back(q, s)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)


def test_per_token_cast_back_reads_float32_and_ue8m0_scales():
    q = torch.zeros(1, 128, dtype=torch.uint8)
    q[0, :4] = torch.tensor([0x7E, 0x30, 0x01, 0xB8], dtype=torch.uint8)  # 448, .5, 2**-9, -1
    fp8 = q.view(getattr(torch, "float8_e4m3fn", torch.uint8))
    back = dmath.per_token_cast_back(fp8, torch.tensor([[0.5]]))
    assert back[0, :4].tolist() == [224.0, 0.25, 2.0 ** -10, -0.5]
    assert back[0, 4:].abs().sum().item() == 0
    # UE8M0: biased exponents 127, 128, 126, 127 packed little-endian in one int32: scales
    # 1, 2, 0.5, 1 for groups 0..3.
    ones = torch.full((1, 512), 0x38, dtype=torch.uint8).view(fp8.dtype)
    packed = torch.tensor([[0x7F7E807F]], dtype=torch.int32)
    back = dmath.per_token_cast_back(ones, packed)
    assert back.view(4, 128).amax(1).tolist() == [1.0, 2.0, 0.5, 1.0]
    assert torch.equal(back.view(4, 128).amin(1), back.view(4, 128).amax(1))
    empty = dmath.per_token_cast_back(q[:0], torch.zeros(0, 1))
    assert empty.shape == (0, 128) and empty.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="scales"):
        dmath.per_token_cast_back(fp8, torch.zeros(1, 2))


def test_e4m3_bytes_decode_to_the_values_that_encode_back_to_them():
    """Every finite e4m3 byte read by per_token_cast_back's decoder (the one a torch without
    float8_e4m3fn uses) is the value _fp8.e4m3_bytes, deepepd's encoder, gives that byte for;
    S.1111.111 is NaN; where torch has float8_e4m3fn its decoding agrees."""
    _fp8 = dmath._fp8  # the module math.py reads (another test file may have dropped deep_ep)
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = dmath._e4m3_values(b)
    finite = (b.int() & 0x7F) != 0x7F
    assert torch.isnan(v[~finite]).all() and not torch.isnan(v[finite]).any()
    assert torch.equal(_fp8.e4m3_bytes(v[finite]), b[finite])
    assert v[0x38].item() == 1.0 and v[0x7E].item() == 448.0 and v[0x01].item() == 2.0 ** -9
    if hasattr(torch, "float8_e4m3fn"):
        torch_v = b.view(torch.float8_e4m3fn).float()
        assert torch.equal(v[finite], torch_v[finite]) and torch.isnan(torch_v[~finite]).all()


def test_per_token_cast_round_trip_is_within_an_e4m3_step(seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(8, 512, generator=g) * 3).bfloat16()
    q, s = dmath.per_token_cast_to_fp8(x)
    back = dmath.per_token_cast_back(q, s)
    # DeepEP's column-major scales (its scripts' x_e4m3[1].T.contiguous().T) read the same.
    assert torch.equal(dmath.per_token_cast_back(q, s.T.contiguous().T), back)
    # Half an e4m3 step: 2**-4 of a normal value, 2**-10 of the scale for a subnormal one;
    # then bf16's rounding of the result (2**-8).
    xf, bf = x.float(), back.float()
    scale = s.repeat_interleave(128, dim=1)
    assert ((bf - xf).abs() <= (2.0 ** -4 + 2.0 ** -8) * xf.abs() + 2.0 ** -10 * scale).all()
    # DeepEP's test_low_latency.py holds an FP8 dispatch and combine to calc_diff < 9e-4.
    assert dmath.calc_diff(back, x) < 9e-4


# ---- deep_ep.utils.testing ---------------------------------------------------------------

def test_bench_returns_average_least_and_greatest_seconds_without_the_first_timed_call(
        monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("times the host path (no CUDA); on CUDA bench times with events")
    # A clock that each call of fn advances by the next duration: 3 warm-ups, then 5 timed
    # calls whose first (100 s) is dropped.
    durations = [7.0, 7.0, 7.0, 100.0, 1.0, 2.0, 3.0, 6.0]
    clock, posts = [0.0], []

    def fn():
        clock[0] += durations.pop(0)

    monkeypatch.setattr(testing.time, "perf_counter", lambda: clock[0])
    got = testing.bench(fn, num_warmups=3, num_tests=5, post_fn=lambda: posts.append(1))
    assert got == (3.0, 1.0, 6.0) and all(type(v) is float for v in got)
    assert durations == [] and len(posts) == 5
    with pytest.raises(ValueError, match="at least 2"):
        testing.bench(fn, num_tests=1)


def test_bench_kineto_names_and_the_nvidia_tools_switch(monkeypatch):
    calls = []
    monkeypatch.setenv("EP_USE_NVIDIA_TOOLS", "1")
    assert testing.bench_kineto(lambda: calls.append(1), "dispatch") == 1
    assert testing.bench_kineto(lambda: calls.append(1), ("dispatch", "combine")) == [1, 1]
    assert calls == []  # nothing is run or profiled under the NVIDIA tools
    with pytest.raises(TypeError, match="kernel_names"):
        testing.bench_kineto(lambda: None, ["dispatch"])
    monkeypatch.setenv("EP_USE_NVIDIA_TOOLS", "yes")
    with pytest.raises(ValueError, match="EP_USE_NVIDIA_TOOLS"):
        testing.bench_kineto(lambda: None, "dispatch")
    monkeypatch.delenv("EP_USE_NVIDIA_TOOLS")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA"):
            testing.bench_kineto(lambda: None, "dispatch")


def test_bench_kineto_times_deepepds_low_latency_kernels_by_deepeps_names(cuda_only, daemon):
    """On cuda: a low-latency dispatch and combine are one kernel each whose names hold
    DeepEP's 'dispatch' and 'combine'; hooked, each is two launches (send, then receive at
    hook()), which num_kernels_per_period=2 splits; DeepEP's 'notify' matches no kernel of
    deepepd's and times 0; bench times the whole pair with events."""
    import test_cuda
    b = test_cuda.one_rank(daemon)
    x, idx, w = test_cuda.tokens()

    def pair(hooked: bool):
        recv, _, h, _, hook = b.low_latency_dispatch(x, idx, 16, 4, use_fp8=False,
                                                     return_recv_hook=hooked)
        if hooked:
            hook()
        _, _, hook = b.low_latency_combine(recv, idx, w, h, return_recv_hook=hooked)
        if hooked:
            hook()

    d, c = testing.bench_kineto(lambda: pair(False), ("dispatch", "combine"), num_tests=4,
                                suppress_kineto_output=True)
    assert d > 0 and c > 0, (d, c)
    d2, c2 = testing.bench_kineto(lambda: pair(True), ("dispatch", "combine"), num_tests=4,
                                  num_kernels_per_period=2)
    assert len(d2) == 2 and len(c2) == 2 and min(d2 + c2) > 0, (d2, c2)
    assert testing.bench_kineto(lambda: pair(False), "notify", num_tests=2) == 0
    avg, least, most = testing.bench(lambda: pair(False), num_warmups=2, num_tests=4)
    assert 0 < least <= avg <= most
    b.destroy()


# ---- deep_ep.utils.envs ------------------------------------------------------------------

def test_launcher_env_reads_nodes_as_deepeps_init_dist(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert envs.launcher_env() == ("127.0.0.1", 8361, 1, 0)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert envs.launcher_env() == ("10.0.0.7", 29500, 2, 1)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"\$RANK=2 must be in \[0, 1\]"):
        envs.launcher_env()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "port")
    with pytest.raises(ValueError, match=r"\$MASTER_PORT='port' is not an integer"):
        envs.launcher_env()
    with pytest.raises(ValueError, match="local_rank 2"):
        envs.init_dist(2, 2)


def test_init_dist_on_cuda_sets_the_device_and_asks_for_nccl_through_torchs_names(monkeypatch):
    """The CUDA path, with torch's functions replaced by recorders (this torch has no CUDA):
    init_dist calls them through torch.cuda and torch.distributed's names, which is what
    bench/deepep_one_gpu.py maps (every device the one GPU, NCCL as gloo), and numbers the
    ranks node by node: RANK=1 of WORLD_SIZE=2 nodes, local rank 1 of 4, is rank 5 of 8."""
    import torch.distributed as dist
    calls = []
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch, "set_default_dtype", lambda t: calls.append(("dtype", t)))
    if hasattr(torch, "set_default_device"):
        monkeypatch.setattr(torch, "set_default_device",
                            lambda d: calls.append(("default_device", d)))

    def init_process_group(backend=None, init_method=None, world_size=-1, rank=-1):
        calls.append(("init", backend, init_method, world_size, rank))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "new_group", lambda r: ("group", tuple(r)))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    assert envs.init_dist(1, 4, seed=3) == (5, 8, ("group", tuple(range(8))))
    assert calls[:2] == [("set_device", 1), ("init", "nccl", "tcp://10.0.0.7:29500", 8, 5)]
    assert ("dtype", torch.bfloat16) in calls
    assert envs.get_local_seed() == 8 and envs.get_global_seed() == 3


def init_dist_rank(local_rank: int, num_local_ranks: int, out: str) -> None:
    """One rank of a DeepEP script's start: init_dist, then a sum over the group it returns,
    dist_print, and what init_dist left set, pickled to out/<local_rank>.pkl."""
    import torch.distributed as dist
    ranks.import_compat()
    from deep_ep.utils.envs import dist_print, get_local_seed, init_dist
    rank, num_ranks, group = init_dist(local_rank, num_local_ranks, seed=40)
    t = torch.tensor([rank + 1], dtype=torch.int32)
    dist.all_reduce(t, group=group)
    dist_print(f"rank {rank}", once_in_node=True)
    got = dict(rank=rank, num_ranks=num_ranks, sum=t.item(), group_size=group.size(),
               backend=str(dist.get_backend()), dtype=str(torch.get_default_dtype()),
               seed=get_local_seed())
    dist.destroy_process_group()
    with open(os.path.join(out, f"{local_rank}.pkl"), "wb") as f:
        pickle.dump(got, f)


def test_init_dist_joins_two_local_ranks_in_one_group(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("runs the gloo path (no CUDA); on CUDA init_dist makes an NCCL group")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(conftest.free_ports()[0]))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with tempfile.TemporaryDirectory(prefix="deepep-utils.") as d:
        got = conftest.spawn_ranks(init_dist_rank, 2, (2, d), d, _SPAWN_TIMEOUT,
                                   "two init_dist ranks")
    for r, g in enumerate(got):
        assert g == dict(rank=r, num_ranks=2, sum=3, group_size=2, backend="gloo",
                         dtype="torch.bfloat16", seed=40 + r)


# ---- the scripts' imports ----------------------------------------------------------------

def test_the_legacy_scripts_import_lines_run_in_a_fresh_interpreter():
    """deep_ep found as an opt-in install lays it out (a deep_ep directory that is
    python/deep_ep_compat), deepep from python/, as conftest's PYTHONPATH has it."""
    with tempfile.TemporaryDirectory(prefix="deepep-utils.") as d:
        os.symlink(os.path.join(conftest.REPO, "python", "deep_ep_compat"),
                   os.path.join(d, "deep_ep"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [d, os.path.join(conftest.REPO, "python")]))
        code = ("import deep_ep.utils.envs, deep_ep.utils.math, deep_ep.utils.testing\n" +
                LEGACY_IMPORTS + "import math\nassert math.sqrt(4) == 2\nprint('ok')\n")
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
