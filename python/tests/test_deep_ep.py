"""deep_ep (the drop-in module) where it differs from deepep.Buffer to be DeepEP's: FP8 scale
layouts and formats, against numpy references of DeepEP's documented semantics."""
import uuid

import numpy as np
import pytest
import torch

import conftest
import ranks
from test_ops import bf16_round, e4m3_reference, expected_rows, ll_rows, quantize_reference

compat = ranks.import_compat()
from deep_ep import _fp8  # noqa: E402  (import_compat has made deep_ep importable)


# ---- the conversions, on CPU tensors ----

def test_e4m3_bytes_round_to_nearest_even_and_saturate_as_the_reference():
    v = np.concatenate([np.linspace(-500, 500, 200001, dtype=np.float32),
                        np.float32(2.0) ** np.arange(-12, 9, 0.25, dtype=np.float32),
                        -np.float32(2.0) ** np.arange(-12, 9, 0.25, dtype=np.float32),
                        np.array([0.0, -0.0, 1e-30, 2 ** -10, 3 * 2 ** -10], np.float32)])
    got = _fp8.e4m3_bytes(torch.from_numpy(v)).numpy()
    np.testing.assert_array_equal(got, e4m3_reference(v))


def deepep_round_reference(rows: np.ndarray):
    """DeepEP's round_scale cast of float32 rows [n, hidden] (bf16 values): per 128 channels
    amax = max(|x|, 1e-4), t = float32(amax * float32(1 / 448)), e = ceil(log2 t) (from
    frexp), scale 2**e, values e4m3(x * 2**-e).  Returns (bytes, e)."""
    g = rows.reshape(rows.shape[0], -1, 128).astype(np.float32)
    amax = np.maximum(np.abs(g).max(2), np.float32(1e-4))
    t = (amax * np.float32(1 / 448)).astype(np.float32)
    m, ex = np.frexp(t)
    e = np.where(m == 0.5, ex - 1, ex).astype(np.int32)
    q = e4m3_reference((g * np.ldexp(np.float32(1), -e)[:, :, None]).astype(np.float32))
    return q.reshape(rows.shape), e


def pack_ue8m0(e: np.ndarray) -> np.ndarray:
    """Biased exponents, group 4 j + i in byte i (little-endian) of int32 j."""
    b = (e + 127).astype(np.uint8)
    return np.ascontiguousarray(b).view("<i4")


def test_round_scale_quantises_with_powers_of_two_as_deepep():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 512)).astype(np.float32) * \
        rng.choice([1e-7, 1e-3, 1.0, 448.0, 5e4], size=(9, 1)).astype(np.float32)
    x[0, :128] = 0  # amax below the floor: the floor's scale
    x[1, :128] = 448 * 2.0 ** -3  # amax / 448 exactly a power of two: no rounding up
    xb = torch.from_numpy(x).bfloat16()
    q, e = _fp8.quantise_rounded(xb)
    wq, we = deepep_round_reference(xb.float().numpy())
    np.testing.assert_array_equal(q.numpy(), wq)
    np.testing.assert_array_equal(e.numpy(), we)
    assert e[1, 0] == -3
    np.testing.assert_array_equal(_fp8.scales_of(e, False).numpy(),
                                  np.ldexp(np.float32(1), we).astype(np.float32))
    np.testing.assert_array_equal(_fp8.scales_of(e, True).numpy(), pack_ue8m0(we))


def test_column_major_keeps_values_with_rows_fastest():
    t = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    c = _fp8.column_major(t)
    assert c.shape == t.shape and c.stride() == (15, 1, 5)
    assert torch.equal(c, t)


# ---- through a job of ranks ----

_WORLD = 2
_res = {}


@pytest.fixture
def scales_world(daemon, seed):
    if "r" not in _res:
        _res["r"] = ranks.run_world(daemon, f"pyscales-{uuid.uuid4().hex[:8]}", _WORLD, seed,
                                    device=conftest.DEVICE, fn=ranks.scales_rank)
    return _res["r"]


def scales_every_input(seed, W, it):
    return [ranks.scales_inputs(seed, s, W, it) for s in range(W)]


def check_column_major(got, name, rows, groups, dtype):
    assert got[name + "_dtype"] == dtype
    assert got[name + "_sc"].shape[1:] == (rows, groups)
    assert tuple(got[name + "_stride"]) == (groups * rows, 1, rows)


def test_low_latency_fp8_scales_are_column_major_and_rounded_as_deepep(scales_world, seed):
    W, res = _WORLD, scales_world
    sh = ranks.scales_shape(W)
    L, rows, G = sh["num_experts"] // W, W * sh["max_ll_tokens_per_rank"], sh["hidden"] // 128
    for it in range(len(res[0])):
        inps = scales_every_input(seed, W, it)
        for inp in inps:
            inp["xb"] = bf16_round(inp["xn"])
        for r in range(W):
            got = res[r][it]
            check_column_major(got, "plain", rows, G, "torch.float32")
            check_column_major(got, "round", rows, G, "torch.float32")
            for name in ("ue8m0", "hooked"):
                check_column_major(got, name, rows, G // 4, "torch.int32")
            for l in range(L):
                want = ll_rows(inps, r * L + l, "xb")
                n = len(want)
                for name in ("plain", "round", "ue8m0", "hooked"):
                    assert got[name + "_count"][l] == n
                if not n:
                    continue
                q, sc = quantize_reference(np.stack(want))
                np.testing.assert_array_equal(got["plain_q"][l, :n], q)
                np.testing.assert_array_equal(got["plain_sc"][l, :n], sc)
                rq, e = deepep_round_reference(np.stack(want))
                np.testing.assert_array_equal(got["round_q"][l, :n], rq)
                np.testing.assert_array_equal(got["round_sc"][l, :n],
                                              np.ldexp(np.float32(1), e).astype(np.float32))
                for name in ("ue8m0", "hooked"):
                    np.testing.assert_array_equal(got[name + "_q"][l, :n], rq)
                    np.testing.assert_array_equal(got[name + "_sc"][l, :n], pack_ue8m0(e))


def test_throughput_fp8_scales_of_deepeps_other_forms_arrive_as_sent(scales_world, seed):
    W, res = _WORLD, scales_world
    L = ranks.scales_shape(W)["num_experts"] // W
    for it in range(len(res[0])):
        inps = scales_every_input(seed, W, it)
        for r in range(W):
            rows, ids, _, _ = expected_rows(inps, r, L, ("q", "sc_i32", "sc_tok", "sc_f32"))
            got = res[r][it]
            n = len(ids)
            for name, key, dtype in (("tp_i32", "sc_i32", "torch.int32"),
                                     ("tp_tok", "sc_tok", "torch.float32"),
                                     ("tp_cm", "sc_f32", "torch.float32")):
                assert got[name + "_dtype"] == dtype
                want = np.stack(rows[key]) if n else \
                    np.zeros((0,) + inps[0][key].shape[1:], inps[0][key].dtype)
                np.testing.assert_array_equal(got[name + "_sc"], want)
                np.testing.assert_array_equal(got[name + "_cached_sc"], want)
                if n:
                    np.testing.assert_array_equal(got[name + "_q"], np.stack(rows["q"]))


def test_use_ue8m0_without_round_scale_is_refused_as_deepep_asserts():
    b = compat.Buffer.__new__(compat.Buffer)  # the check runs before any use of the Buffer
    x = torch.zeros((1, 512), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="use_ue8m0=True needs round_scale=True"):
        b.low_latency_dispatch(x, torch.zeros((1, 4), dtype=torch.int64), 16, 4,
                               use_ue8m0=True)
    with pytest.raises(ValueError, match="hidden must be a multiple of 512"):
        b.low_latency_dispatch(torch.zeros((1, 256), dtype=torch.bfloat16),
                               torch.zeros((1, 4), dtype=torch.int64), 16, 4,
                               round_scale=True, use_ue8m0=True)


# ---- destroy, set_num_sms, configs and size hints ----

_SHAPE = dict(hidden=128, num_experts=4, num_topk=2, max_tokens_per_rank=8)


def one_rank(daemon, **kw):
    return compat.Buffer(None, 1 << 20, 0, job_id="de-" + uuid.uuid4().hex[:8], rank=0,
                         world_size=1, socket=daemon, **_SHAPE, **kw)


def a_dispatch(b):
    x = torch.ones((2, 128), dtype=torch.bfloat16, device=b.device)
    idx = torch.tensor([[0, 1], [2, 3]], device=b.device)
    return b.dispatch(x, topk_idx=idx, topk_weights=torch.ones((2, 2), device=b.device))


def test_destroy_is_deepeps_with_and_without_explicitly_destroy(daemon, capsys):
    """destroy() releases a Buffer made with or without explicitly_destroy (DeepEP's
    test_low_latency.py calls it on one made without), once; a Buffer made without it and
    never destroyed is released when collected, without DeepEP's warning.  It raised
    AssertionError without the flag, which failed DeepEP's script at its last line."""
    import gc
    b = one_rank(daemon)
    b.destroy()
    with pytest.raises(RuntimeError, match="already called"):
        b.destroy()
    with pytest.raises(compat._deepep.Error, match="destroyed"):
        a_dispatch(b)
    del b
    b = one_rank(daemon)
    a_dispatch(b)
    del b
    gc.collect()
    assert "WARNING" not in capsys.readouterr().out
    b = one_rank(daemon, explicitly_destroy=True)
    a_dispatch(b)
    b.destroy()
    with pytest.raises(RuntimeError, match="already called"):
        b.destroy()
    with pytest.raises(compat._deepep.Error, match="destroyed"):
        a_dispatch(b)
    del b
    gc.collect()
    assert "WARNING" not in capsys.readouterr().out
    b = one_rank(daemon, explicitly_destroy=True)
    a_dispatch(b)
    del b
    gc.collect()
    assert "destroy() was not called" in capsys.readouterr().out


def test_set_num_sms_on_deep_ep_is_the_num_sms_of_its_configs():
    """DeepEP's get_dispatch_config/get_combine_config carry Buffer.num_sms as set_num_sms set
    it; deep_ep.Buffer's carried deepep.Buffer's (20) whatever deep_ep's was set to."""
    B = compat.Buffer
    try:
        B.set_num_sms(24)
        assert B.num_sms == 24
        assert B.get_dispatch_config(8).num_sms == 24 and B.get_combine_config(8).num_sms == 24
        with pytest.raises(ValueError, match="even"):
            B.set_num_sms(23)
    finally:
        if "num_sms" in B.__dict__:
            del B.num_sms


def test_size_hints_are_deepeps_formulas():
    """DeepEP V1's csrc/config.hpp, written out: the low-latency layout (two send, receive
    and signalling buffers, rounded up past the next 128) and Config's NVLink and RDMA hints
    (per channel and peer, counters and chunked tokens with their metadata).  They were
    deepepd's own estimates."""
    M, H, E = 128, 7168, 288
    scales = H // 128
    dmsg, cmsg = 16 + max(2 * H, H + 4 * scales), 4 * scales + 2 * H
    total = 2 * max(M * dmsg, E * M * cmsg) + 2 * E * M * max(dmsg, cmsg) + 2 * 1152
    want = (total + 128) // 128 * 128
    assert want == 2146961792
    for ranks_ in (8, 16, 64):
        assert compat.Buffer.get_low_latency_rdma_size_hint(M, H, ranks_, E) == want
    c = compat.Config(24, 6, 256, 6, 128)
    per_token = 2 * H + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nvl = 12 * 8 * (2 * 1 + 3) * 4 + 12 * 8 * 256 * per_token
    assert c.get_nvl_buffer_size_hint(2 * H, 8) == (nvl + 127) // 128 * 128
    assert c.get_rdma_buffer_size_hint(2 * H, 8) == 0
    # Config rounds the RDMA receive count (128) up to a multiple of the send count (6): 132.
    rdma = 12 * 2 * 18 * 2 * 4 + 12 * 2 * 132 * (per_token + 16) * 2
    assert c.get_rdma_buffer_size_hint(2 * H, 16) == (rdma + 127) // 128 * 128
    nvl16 = 12 * 8 * (2 * 2 + 3) * 4 + 12 * 8 * 256 * per_token
    assert c.get_nvl_buffer_size_hint(2 * H, 16) == (nvl16 + 127) // 128 * 128


def job_flags(daemon, job_id: str) -> int:
    """The flags deepepd holds for job_id (its dep_status job record)."""
    def read(st):
        return {st.jobs[i].job_id.decode(): st.jobs[i].flags for i in range(st.num_jobs)}
    return conftest.daemon_status(daemon, read)[job_id]


def test_enable_shrink_and_elastic_make_the_job_elastic(daemon):
    """deep_ep's enable_shrink=True and deepep's elastic=True attach with DEP_ATTACH_ELASTIC
    (deepepd masks a rank that dies instead of failing the job); without them, no flag.
    enable_shrink was accepted and changed nothing."""
    from deepep import _lib
    import deepep
    b = one_rank(daemon, enable_shrink=True, explicitly_destroy=True)
    assert b.elastic and job_flags(daemon, b.identity.job_id) == _lib.ATTACH_ELASTIC
    b.destroy()
    b = one_rank(daemon, explicitly_destroy=True)
    assert not b.elastic and job_flags(daemon, b.identity.job_id) == 0
    b.destroy()
    d = deepep.Buffer(job_id="el-" + uuid.uuid4().hex[:8], rank=0, world_size=1, socket=daemon,
                      elastic=True, **_SHAPE)
    assert job_flags(daemon, d.identity.job_id) == _lib.ATTACH_ELASTIC
    d.destroy()
