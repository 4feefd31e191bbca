"""Every integer the binding hands to libdeepep-client is checked against the C field it
crosses into (and the library's bounds the binding knows) before anything is sent: ctypes
keeps only the low bits of an int too wide for its field, so Buffer(num_experts=2**32 + 4)
attached with num_experts 4.  A socket path with a NUL character is refused, not cut at it.
Each refusal is a ValueError naming the argument and its range, and the daemon never hears
of the job."""
import ctypes
import sys
import uuid

import pytest
import torch

import conftest
import deepep
from deepep import _lib

from test_buffer import SHAPE, import_compat, one_rank, tokens

DEV = torch.device(conftest.DEVICE)
U32 = 2**32 - 1


def daemon_jobs(sock):
    """The job ids the daemon holds now (dep_status)."""
    jobs = conftest.daemon_status(sock, lambda st: {st.jobs[i].job_id.decode()
                                                    for i in range(st.num_jobs)})
    assert jobs is not None, f"dep_status of the daemon at {sock} failed"
    return jobs


def refused(daemon, job_id, call, match):
    """call() raises ValueError matching `match`, and job_id never reached the daemon."""
    with pytest.raises(ValueError, match=match):
        call()
    assert job_id not in daemon_jobs(daemon)


# (argument, value, the range the message names): just past each end of every integer the
# constructor passes on, the job shape's uint32_t fields and the identity's library bounds.
CONSTRUCTOR = [
    ("hidden", 2**32 + 128, f"1..{U32}"),
    ("hidden", 2**32, f"1..{U32}"),
    ("hidden", 0, f"1..{U32}"),
    ("num_experts", 2**32 + 4, f"1..{U32}"),
    ("num_experts", -4, f"1..{U32}"),
    ("num_topk", 2**32 + 2, f"1..{U32}"),
    ("max_tokens_per_rank", 2**32 + 8, f"1..{U32}"),
    ("max_tokens_per_rank", 2**64 + 8, f"1..{U32}"),
    ("max_ll_tokens_per_rank", 2**32 + 8, f"1..{U32}"),
    ("rank", 2**32, f"0..{_lib.MAX_WORLD - 1}"),
    ("rank", -1, f"0..{_lib.MAX_WORLD - 1}"),
    ("world_size", 2**32 + 1, f"1..{_lib.MAX_WORLD}"),
    ("world_size", _lib.MAX_WORLD + 1, f"1..{_lib.MAX_WORLD}"),
    ("local_rank", 2**32, f"0..{_lib.MAX_LOCAL_RANKS - 1}"),
    ("local_rank", -1, f"0..{_lib.MAX_LOCAL_RANKS - 1}"),
    ("local_world_size", 2**32 + 1, f"1..{_lib.MAX_LOCAL_RANKS}"),
    ("local_world_size", 0, f"1..{_lib.MAX_LOCAL_RANKS}"),
]


@pytest.mark.parametrize("name,value,allowed", CONSTRUCTOR,
                         ids=[f"{n}={v}" for n, v, _ in CONSTRUCTOR])
def test_an_integer_out_of_its_c_range_is_refused_before_the_attach(daemon, name, value,
                                                                    allowed):
    job = "r-" + uuid.uuid4().hex[:10]
    kw = dict(SHAPE, job_id=job, rank=0, world_size=1, local_rank=0, local_world_size=1,
              socket=daemon)
    kw[name] = value
    refused(daemon, job, lambda: deepep.Buffer(**kw), f"^{name} is {value}; it must be in "
            f"{allowed}$")


def test_a_shape_bound_from_the_environment_is_checked_and_named(daemon, monkeypatch):
    job = "r-" + uuid.uuid4().hex[:10]
    monkeypatch.setenv("DEEPEP_MAX_TOKENS_PER_RANK", str(2**32 + 8))
    shape = dict(SHAPE)
    del shape["max_tokens_per_rank"]
    refused(daemon, job, lambda: one_rank(daemon, job_id=job, **shape),
            f"DEEPEP_MAX_TOKENS_PER_RANK is {2**32 + 8}; it must be in 1..{U32}")


def test_the_largest_value_of_a_field_crosses_whole(daemon):
    """2**32 - 1 fits the field, so it is the library's to judge: it refuses it by its own
    bound, naming the value it got (a truncated one would have been another)."""
    with pytest.raises(deepep.InvalidArgument, match=str(U32)):
        one_rank(daemon, **dict(SHAPE, num_experts=U32))


# Shapes an operation supplies to a Buffer made without one: (what the message names, the
# value, the call).  A tensor with no elements may have any width, so x.size(1) and
# topk_idx.size(1) reach past 2**32 without memory.
def _wide_x(b):
    x = torch.empty(0, 2**32 + 128, dtype=torch.bfloat16, device=DEV)
    idx = torch.empty(0, 2, dtype=torch.int64, device=DEV)
    w = torch.empty(0, 2, dtype=torch.float32, device=DEV)
    return b.dispatch(x, topk_idx=idx, topk_weights=w,
                      num_tokens_per_expert=torch.zeros(4, dtype=torch.int32, device=DEV))


def _wide_topk(b):
    x = torch.empty(0, 128, dtype=torch.bfloat16, device=DEV)
    idx = torch.empty(0, 2**32 + 2, dtype=torch.int64, device=DEV)
    w = torch.empty(0, 2**32 + 2, dtype=torch.float32, device=DEV)
    return b.dispatch(x, topk_idx=idx, topk_weights=w,
                      num_tokens_per_expert=torch.zeros(4, dtype=torch.int32, device=DEV))


OPERATION = [
    ("get_dispatch_layout: num_experts", 2**32 + 4,
     lambda b: b.get_dispatch_layout(tokens()[1], 2**32 + 4)),
    ("dispatch: x.size(1)", 2**32 + 128, _wide_x),
    ("dispatch: topk_idx.size(1)", 2**32 + 2, _wide_topk),
    ("low_latency_dispatch: num_max_dispatch_tokens_per_rank", 2**32 + 8,
     lambda b: b.low_latency_dispatch(*tokens()[:2], 2**32 + 8, 4)),
    ("low_latency_dispatch: num_experts", 2**32 + 4,
     lambda b: b.low_latency_dispatch(*tokens()[:2], 8, 2**32 + 4)),
    ("clean_low_latency_buffer: hidden", 2**32 + 128,
     lambda b: b.clean_low_latency_buffer(8, 2**32 + 128, 4)),
]


@pytest.mark.parametrize("what,value,call", OPERATION, ids=[w for w, _, _ in OPERATION])
def test_a_shape_an_operation_supplies_is_checked_before_it_is_taken(daemon, what, value, call):
    job = "r-" + uuid.uuid4().hex[:10]
    b = one_rank(daemon, job_id=job, max_tokens_per_rank=8, max_ll_tokens_per_rank=8,
                 **({"num_topk": 2} if what.startswith("clean") else {}))
    try:
        refused(daemon, job, lambda: call(b),
                f"^{what.replace('(', '[(]').replace(')', '[)]')} is {value}; it must be in "
                f"1..{U32}$")
        # Nothing was taken: the Buffer still has no shape, and attaches with the right one.
        assert not b.attached and (b.hidden, b.num_experts) == (None, None)
        x, idx, w = tokens()
        assert b.dispatch(x, topk_idx=idx, topk_weights=w,
                          num_tokens_per_expert=torch.zeros(4, dtype=torch.int32,
                                                            device=DEV))[3] == [2, 2, 2, 2]
        assert (b.hidden, b.num_experts, b.num_topk) == (128, 4, 2)
    finally:
        b.destroy()


def test_an_attached_buffer_refuses_a_wide_shape_naming_its_range(daemon):
    b = one_rank(daemon, **SHAPE)
    try:
        with pytest.raises(ValueError, match=f"num_experts is {2**32 + 4}; it must be in "):
            b.get_dispatch_layout(tokens()[1], 2**32 + 4)
        assert b.num_experts == 4
    finally:
        b.destroy()


@pytest.mark.parametrize("value", [2**32 + 1, 2**32, 0, -1])
def test_dispatch_expert_alignment_is_checked_against_its_field(daemon, value):
    b = one_rank(daemon, **SHAPE)
    try:
        x, idx, w = tokens()
        with pytest.raises(ValueError, match=f"^dispatch: expert_alignment is {value}; it must "
                           f"be in 1..{U32}$"):
            b.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=value)
        assert b.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=2)[3] == [2] * 4
    finally:
        b.destroy()


@pytest.mark.parametrize("suffix", ["\0", "\0.other", "\0/../d.sock"])
def test_a_socket_path_with_a_nul_is_refused_not_cut(daemon, suffix):
    """The path up to the NUL is the daemon's: the old binding connected there."""
    job = "r-" + uuid.uuid4().hex[:10]
    refused(daemon, job, lambda: one_rank(daemon + suffix, job_id=job, **SHAPE),
            "socket .* contains a NUL character")


def test_a_job_id_ending_in_a_newline_is_refused(daemon):
    job = "r-" + uuid.uuid4().hex[:10]
    refused(daemon, job, lambda: one_rank(daemon, job_id=job + "\n", **SHAPE), "job_id")


def test_the_deep_ep_module_passes_its_integers_through_the_same_checks(daemon):
    mod = import_compat()
    try:
        job = "r-" + uuid.uuid4().hex[:10]
        refused(daemon, job,
                lambda: mod.Buffer(None, 0, 0, job_id=job, rank=0, world_size=1, socket=daemon,
                                   **dict(SHAPE, num_experts=2**32 + 4)),
                f"num_experts is {2**32 + 4}; it must be in 1..{U32}")
    finally:
        for name in ("deep_ep.utils", "deep_ep"):
            sys.modules.pop(name, None)


def test_checked_int_takes_the_range_of_the_c_type():
    assert _lib.c_range(ctypes.c_uint32) == (0, U32)
    assert _lib.c_range(ctypes.c_int32) == (-2**31, 2**31 - 1)
    assert _lib.c_range(ctypes.c_uint64) == (0, 2**64 - 1)
    assert _lib.checked_int("n", 2**31 - 1, ctypes.c_int32) == 2**31 - 1
    with pytest.raises(ValueError, match=f"^n is {2**31}; it must be in {-2**31}..{2**31 - 1}$"):
        _lib.checked_int("n", 2**31, ctypes.c_int32)
    with pytest.raises(ValueError, match="^n is 9; it must be in 1..8$"):
        _lib.checked_int("n", 9, ctypes.c_uint32, 1, 8)
    with pytest.raises(TypeError, match="n must be an int, not bool"):
        _lib.checked_int("n", True, ctypes.c_uint32)
