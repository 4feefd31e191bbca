"""deepep.Buffer's contract outside the data path: identity, errors, refused arguments and
the deep_ep compatibility module (events, Config and the per-call state: test_buffer_calls.py)."""
import ctypes
import os
import subprocess
import sys
import uuid

import pytest
import torch

import conftest
import deepep
import ranks
from deepep.identity import from_environment
from onerank import DEV, SHAPE, one_rank, tokens

# ---- identity ----------------------------------------------------------------

def test_identity_comes_from_torchrun():
    env = dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               TORCHELASTIC_RUN_ID="run42")
    i = from_environment(env)
    assert (i.job_id, i.rank, i.world_size, i.local_rank, i.local_world_size) == \
        ("run42", 3, 8, 1, 2)


def test_identity_comes_from_slurm_with_tasks_per_node_list():
    env = dict(SLURM_PROCID="5", SLURM_NTASKS="7", SLURM_LOCALID="1", SLURM_NODEID="1",
               SLURM_TASKS_PER_NODE="4,3", SLURM_JOB_ID="991", SLURM_STEP_ID="0")
    i = from_environment(env)
    assert (i.job_id, i.rank, i.world_size, i.local_rank, i.local_world_size) == \
        ("slurm-991.0", 5, 7, 1, 3)
    env["SLURM_TASKS_PER_NODE"] = "2(x3),1"
    env["SLURM_NODEID"] = "2"
    assert from_environment(env).local_world_size == 2


def test_deepep_job_id_overrides_and_arguments_override_the_environment():
    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               TORCHELASTIC_RUN_ID="a", DEEPEP_JOB_ID="b")
    assert from_environment(env).job_id == "b"
    assert from_environment(env, job_id="c", rank=1, local_rank=1).rank == 1


def test_identity_missing_or_wrong_names_the_field():
    with pytest.raises(ValueError, match="job_id"):
        from_environment({}, rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2 is not below world_size 2"):
        from_environment({}, job_id="j", rank=2, world_size=2)
    with pytest.raises(ValueError, match="job_id"):
        from_environment({}, job_id="has space", rank=0, world_size=1)
    with pytest.raises(ValueError, match="RANK"):
        from_environment(dict(RANK="x", WORLD_SIZE="1"))


def test_clean_low_latency_buffer_names_its_own_argument(buf):
    # Its hidden is an argument, not x.size(1) (there is no x): the message said x.size(1).
    with pytest.raises(ValueError, match="clean_low_latency_buffer: hidden is 256 but this "
                                         "Buffer's job has hidden 128"):
        buf.clean_low_latency_buffer(8, 256, 4)
    buf.clean_low_latency_buffer(8, 128, 4)


def test_configs_for_a_rank_count_that_cannot_be_are_refused():
    # Any positive count gets a Config (Megatron asks for its group's size, whatever it is);
    # 0, a negative one or a non-int was handed a Config too.
    for n in (1, 3, 8, 160, 1000):
        assert deepep.Buffer.get_dispatch_config(n).num_sms == deepep.Buffer.num_sms
        assert deepep.Buffer.get_combine_config(n).num_sms == deepep.Buffer.num_sms
    for get in (deepep.Buffer.get_dispatch_config, deepep.Buffer.get_combine_config):
        with pytest.raises(ValueError, match="num_ranks is 0; it must be positive"):
            get(0)
        with pytest.raises(ValueError, match="num_ranks is -1"):
            get(-1)
        with pytest.raises(TypeError, match="num_ranks must be an int, not float"):
            get(8.0)


def test_a_wrong_type_is_a_type_error_and_a_wrong_value_a_value_error():
    # As the Buffer's docstring and Python's own conventions have it: a negative rank is a bad
    # value (it was a TypeError), a float byte count a bad type (it was a ValueError).
    with pytest.raises(ValueError, match="rank is -1; it must be in 0..4095"):
        from_environment({}, job_id="j", rank=-1, world_size=1, local_rank=0,
                         local_world_size=1)
    with pytest.raises(ValueError, match="local_rank is -1"):
        from_environment({}, job_id="j", rank=0, world_size=1, local_rank=-1,
                         local_world_size=1)
    with pytest.raises(TypeError, match="rank must be an int, not str"):
        from_environment({}, job_id="j", rank="0", world_size=1)
    with pytest.raises(TypeError, match="num_nvl_bytes must be an int, not float"):
        deepep.Buffer(None, 1.5, job_id="j", rank=0, world_size=1)
    with pytest.raises(ValueError, match="num_rdma_bytes is -1; it must be 0 or more"):
        deepep.Buffer(None, 0, -1, job_id="j", rank=0, world_size=1)


# ---- errors --------------------------------------------------------------------

def test_missing_daemon_says_how_to_start_it(tmp_path):
    with pytest.raises(deepep.NoDaemon) as e:
        one_rank(str(tmp_path / "none.sock"), **SHAPE)
    assert e.value.name == "DEP_ERR_NO_DAEMON" and e.value.code == -5
    assert "deepepd" in str(e.value) and "none.sock" in str(e.value)


def test_the_library_is_loaded_at_import_and_a_missing_one_fails_buffer_not_the_import():
    """`import deepep` loads libdeepep-client (as DeepEP loads its extension); where
    $DEEPEP_CLIENT_LIB names no library the import still works and Buffer(...) raises the
    loader's error, naming the variable and how to build the library."""
    code = ("import deepep, deepep._lib as L\n"
            "print('loaded' if L._lib is not None else 'not loaded')\n"
            "try:\n"
            "    deepep.Buffer(job_id='j', rank=0, world_size=1, socket='/nonexistent.sock')\n"
            "except OSError as e:\n"
            "    print('OSError:', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = lambda lib: subprocess.run([sys.executable, "-c", code], capture_output=True,  # noqa
                                     text=True, env=dict(env, DEEPEP_CLIENT_LIB=lib),
                                     timeout=120)
    ok = run(os.environ["DEEPEP_CLIENT_LIB"])
    assert ok.returncode == 0 and ok.stdout.startswith("loaded"), ok.stderr
    bad = run("/nonexistent/libdeepep-client.so.0")
    assert bad.returncode == 0 and bad.stdout.startswith("not loaded"), bad.stderr
    assert "OSError: deepep: cannot load libdeepep-client" in bad.stdout
    assert "$DEEPEP_CLIENT_LIB" in bad.stdout and "Build it (make)" in bad.stdout
    # A library that loads but is not this package's libdeepep-client (another library, or an
    # older build lacking a function) is refused the same way; the import used to fail there
    # with ctypes' AttributeError.
    other = run("libc.so.6")
    assert other.returncode == 0 and other.stdout.startswith("not loaded"), other.stderr
    assert "OSError: deepep: cannot load libdeepep-client" in other.stdout
    assert "libc.so.6 ($DEEPEP_CLIENT_LIB): it has no dep_" in other.stdout


def test_the_daemon_refusing_a_shape_is_an_error_with_code_name_and_message(daemon):
    with pytest.raises(deepep.InvalidArgument) as e:
        one_rank(daemon, **dict(SHAPE, hidden=100))
    assert e.value.name == "DEP_ERR_INVALID" and "hidden" in e.value.message
    assert isinstance(e.value, ValueError) and isinstance(e.value, deepep.Error)


def test_a_group_without_torch_distributed_is_refused_saying_why(daemon):
    """The identity of a Buffer given a group is the group's (test_group.py); without an
    initialised torch.distributed there is none to take."""
    class Group:
        def size(self):
            return 2
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        one_rank(daemon, group=Group(), **SHAPE)


def test_layout_comes_before_any_dispatch_on_a_buffer_without_hidden(daemon):
    """Megatron's order: Buffer(group, nvl, rdma), get_dispatch_layout, then dispatch; the
    layout before the attach (hidden unknown) equals the library's after it."""
    shape = {k: v for k, v in SHAPE.items() if k != "hidden"}
    b = one_rank(daemon, world_size=2, local_world_size=1, local_rank=0,
                 **dict(shape, num_experts=8, num_topk=3))
    idx = torch.tensor([[0, 5, -1], [7, 6, 4], [-1, -1, -1], [1, 2, 3], [3, -1, 0]],
                       dtype=torch.int64, device=DEV)
    per_rank, rdma, per_expert, in_rank, ev = b.get_dispatch_layout(idx, 8, async_finish=True)
    assert not b.attached and ev.event is not None
    # Two nodes of one rank each: per node, the tokens of its one rank.
    assert rdma.dtype == torch.int32 and rdma.tolist() == [3, 2]
    assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32
    assert in_rank.dtype == torch.bool and per_rank.device == DEV
    assert per_rank.tolist() == [3, 2]
    assert per_expert.tolist() == [2, 1, 1, 2, 1, 1, 1, 1]
    assert in_rank.tolist() == [[True, True], [False, True], [False, False], [True, False],
                                [True, False]]
    # int32 ids too, and the library's checks: ids out of range, a wrong num_experts.
    assert torch.equal(b.get_dispatch_layout(idx.int(), 8)[3], in_rank)
    with pytest.raises(deepep.InvalidArgument, match="expert 8"):
        b.get_dispatch_layout(torch.tensor([[8, 0, 1]], device=DEV), 8)
    with pytest.raises(ValueError, match="num_experts"):
        b.get_dispatch_layout(idx, 16)
    assert not b.attached
    b.destroy()
    # The same ids through dep_layout, on a Buffer that has attached (a world of one, which
    # attaches alone): its world differs, so compare against a one-rank layout computed
    # before that Buffer's attach.
    shape1 = dict(shape, num_experts=8, num_topk=3)
    b = one_rank(daemon, **shape1)
    before = b.get_dispatch_layout(idx, 8)
    assert not b.attached
    b.dispatch(torch.zeros(5, 128, dtype=torch.bfloat16, device=DEV), topk_idx=idx,
               topk_weights=torch.ones(5, 3, device=DEV))
    assert b.attached
    after = b.get_dispatch_layout(idx, 8)
    for i in (0, 2, 3):
        assert torch.equal(before[i], after[i]), i
    b.destroy()


def test_layout_counts_tokens_per_node_in_a_job_across_nodes(daemon):
    """DeepEP's num_tokens_per_rdma_rank: per node, the tokens that go to at least one of its
    ranks; a world of 4 in nodes of 2 (from the environment: ranks node by node), before the
    Buffer attaches (it never does here: no other rank comes)."""
    import dataclasses
    b = one_rank(daemon, world_size=4, local_world_size=2, local_rank=0, num_experts=8,
                 num_topk=3, max_tokens_per_rank=8)
    # Experts 0-1 are rank 0's, 2-3 rank 1's (node 0), 4-5 rank 2's, 6-7 rank 3's (node 1).
    idx = torch.tensor([[0, 2, -1], [4, 6, 7], [-1, -1, -1], [1, 3, 5], [0, 1, -1],
                        [6, -1, -1]], dtype=torch.int64, device=DEV)
    per_rank, rdma, _, in_rank, _ = b.get_dispatch_layout(idx, 8)
    assert not b.attached and per_rank.tolist() == [3, 2, 2, 2]
    assert rdma.dtype == torch.int32 and rdma.device == DEV and rdma.tolist() == [3, 3]
    assert b.identity.node_of() == (0, 0, 1, 1)
    # Where the group said the hosts, its nodes count: ranks 0 and 2 on one, 1 and 3 on the
    # other (an expert-parallel group across data-parallel replicas).
    b.identity = dataclasses.replace(b.identity, nodes=(0, 1, 0, 1))
    b._node_index = None
    assert b.get_dispatch_layout(idx, 8)[1].tolist() == [4, 4]
    b.destroy()
    # One node: None, as DeepEP's; and a world of uneven nodes from the environment, whose
    # ranks' nodes are unknown, None too.
    one = one_rank(daemon, world_size=4, local_world_size=4, local_rank=0, num_experts=8,
                   num_topk=3)
    assert one.get_dispatch_layout(idx, 8)[1] is None
    one.destroy()
    uneven = one_rank(daemon, world_size=3, local_world_size=2, local_rank=0, num_experts=6,
                      num_topk=3)
    assert uneven.identity.node_of() is None
    assert uneven.get_dispatch_layout(idx.clamp(max=5), 6)[1] is None
    uneven.destroy()


def test_bad_tensors_are_refused_naming_the_argument(buf):
    x, idx, w = tokens()
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        buf.dispatch(x.float(), topk_idx=idx, topk_weights=w)
    with pytest.raises(TypeError, match="topk_idx has dtype torch.float32"):
        buf.dispatch(x, topk_idx=idx.float(), topk_weights=w)
    with pytest.raises(TypeError, match="topk_weights has dtype torch.float64"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w.double())
    with pytest.raises(ValueError, match="topk_idx has 3 rows but x has 4"):
        buf.dispatch(x, topk_idx=idx[:3], topk_weights=w)
    with pytest.raises(ValueError, match="x.size\\(1\\) is 256 but this Buffer's job has hidden"):
        buf.dispatch(torch.ones(4, 256, dtype=torch.bfloat16, device=DEV), topk_idx=idx,
                     topk_weights=w)
    with pytest.raises(ValueError, match="9 tokens exceed max_tokens_per_rank 8"):
        buf.dispatch(*tokens(9)[:1], topk_idx=tokens(9)[1], topk_weights=tokens(9)[2])
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank is 16"):
        buf.low_latency_dispatch(x, idx, 16, 4)
    with pytest.raises(TypeError, match="handle must be the Handle"):
        buf.combine(x, handle=("a", "tuple"))


def test_expert_ids_out_of_range_are_the_librarys_invalid_argument(buf):
    x, idx, w = tokens()
    idx[1, 1] = 7
    # The host library names the element; the cuda kernels the token (found on the GPU).
    want = r"topk_idx\[1\]\[1\] = 7" if conftest.BACKEND == "host" else \
        r"topk_idx of token 1 = 7"
    with pytest.raises(deepep.InvalidArgument, match=want):
        buf.dispatch(x, topk_idx=idx, topk_weights=w)
    idx[1, 1] = 2  # and the Buffer goes on
    assert buf.dispatch(x, topk_idx=idx, topk_weights=w)[3] == [2, 2, 2, 2]


def test_arguments_not_in_the_library_yet_raise_unsupported(buf):
    x, idx, w = tokens()
    _, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    q = torch.zeros(4, 128, dtype=torch.uint8, device=DEV)
    packed = torch.ones(4, 1, dtype=torch.int32, device=DEV)  # DeepEP's UE8M0, four an int
    cases = [
        lambda: buf.low_latency_dispatch(x, idx, 8, 4, round_scale=True),
        # docs/python.md lists int32 scales in an FP8 tuple among these (it was a TypeError)
        lambda: buf.dispatch((q, packed), topk_idx=idx, topk_weights=w),
    ]
    names = ["round_scale", "int32 (packed UE8M0) FP8 scales"]
    for case, name in zip(cases, names):
        with pytest.raises(deepep.Unsupported, match="not in libdeepep-client yet") as e:
            case()
        assert name in str(e.value)
        assert isinstance(e.value, NotImplementedError)


def test_a_wrong_bias_is_refused_naming_it_before_the_combine_is_sent(buf):
    x, idx, w = tokens()
    rx, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    for bias, err, msg in (
            (x.float(), TypeError, r"bias has dtype torch.float32; it must be torch.bfloat16"),
            (x[:3], ValueError, r"bias has shape \(3, 128\); expected \(4, 128\)"),
            ((x, x, x), ValueError, "bias is a tuple of 3 items"),
            ((x, "b"), TypeError, r"bias\[1\] must be a torch.Tensor or None, not str")):
        with pytest.raises(err, match=msg):
            buf.combine(rx, h, bias=bias)
    # Nothing was sent: the handle's combine is still to be made, and adds the bias.
    out, _, _ = buf.combine(rx, h, bias=(None, x))
    assert torch.equal(out, (x.float() * 2).bfloat16())


def test_bad_fp8_cached_worst_and_weight_arguments_name_the_argument(buf):
    x, idx, w = tokens()
    q = torch.zeros(4, 128, dtype=torch.uint8, device=DEV)
    sc = torch.ones(4, 1, device=DEV)
    _, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    cases = [
        (lambda: buf.dispatch((q, sc, sc), topk_idx=idx, topk_weights=w), ValueError,
         "a tuple \\(values, scales\\)"),
        (lambda: buf.dispatch((x, sc), topk_idx=idx, topk_weights=w), TypeError,
         "FP8 values must be"),
        (lambda: buf.dispatch((q, sc.double()), topk_idx=idx, topk_weights=w), TypeError,
         "x scales has dtype torch.float64"),
        (lambda: buf.dispatch((q, torch.ones(4, 2, device=DEV)), topk_idx=idx, topk_weights=w),
         ValueError, "FP8 scales have shape \\(4, 2\\)"),
        (lambda: buf.dispatch(x, handle=h, topk_idx=idx), ValueError, "pass no topk_idx"),
        (lambda: buf.dispatch(x[:3], handle=h), ValueError, "x has 3 tokens but the handle"),
        (lambda: buf.dispatch(x, handle=h, expert_alignment=4), ValueError, "expert_alignment"),
        (lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=9), ValueError,
         "num_worst_tokens 9 exceeds the 8 rows"),
        (lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=-1), ValueError,
         "num_worst_tokens is -1"),
        (lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=0), ValueError,
         "expert_alignment is 0"),
        (lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=1 << 17),
         deepep.InvalidArgument, "expert_alignment 131072 exceeds 65536"),
        (lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=2.0), TypeError,
         "num_worst_tokens must be an int"),
        (lambda: buf.combine(x, h, topk_weights=w[:, :1]), ValueError,
         "topk_weights has shape \\(4, 1\\)"),
        (lambda: buf.combine(x, h, topk_weights=w.double()), TypeError,
         "topk_weights has dtype torch.float64"),
    ]
    for case, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            case()
    # and the Buffer goes on
    assert buf.dispatch(x, topk_idx=idx, topk_weights=w)[3] == [2, 2, 2, 2]


def test_argument_structs_carry_their_size_and_grow_safely(buf):
    """deepep.h: a size of 0 is refused naming the fix; a larger struct whose unknown tail is
    zero works (a newer caller asking for defaults); a non-zero tail is DEP_ERR_UNSUPPORTED."""
    from deepep import _lib
    lib, conn = buf._conn.lib, buf._conn
    x, idx, _ = tokens()
    per_rank = torch.empty(1, dtype=torch.int32, device=DEV)
    per_expert = torch.empty(4, dtype=torch.int32, device=DEV)
    in_rank = torch.empty(4, 1, dtype=torch.bool, device=DEV)
    a = _lib.LayoutArgs(idx.data_ptr(), _lib.INDEX_I64, 4, per_rank.data_ptr(),
                        per_expert.data_ptr(), in_rank.data_ptr())
    stream = None if conftest.BACKEND == "host" else torch.cuda.current_stream().cuda_stream
    assert lib.dep_layout(conn.ptr, ctypes.byref(a), stream) == 0
    a.size = 0
    assert lib.dep_layout(conn.ptr, ctypes.byref(a), stream) == _lib.ERR_INVALID
    assert "is 0; set .size = sizeof(struct dep_layout_args)" in conn.errmsg()
    n = ctypes.sizeof(a)
    big = (ctypes.c_uint8 * (n + 16))()
    a.size = n + 16
    ctypes.memmove(big, ctypes.byref(a), n)
    assert lib.dep_layout(conn.ptr, ctypes.cast(big, ctypes.POINTER(_lib.LayoutArgs)), stream) == 0
    big[n + 3] = 1
    assert lib.dep_layout(conn.ptr, ctypes.cast(big, ctypes.POINTER(_lib.LayoutArgs)),
                          stream) == _lib.ERR_UNSUPPORTED
    assert "does not know" in conn.errmsg()


def test_dispatch_writes_int64_ids_and_a_caller_of_the_0_3_0_struct_gets_int32(buf):
    """recv_index_type (0.4.0): DEP_INDEX_I64 writes the received ids as int64; a caller of
    the 0.3.0 struct, whose size ends where recv_index_type begins and whose tail padding
    (now `reserved`) it may leave unset, gets int32 ids as before, whatever lies past its
    size; any other type is refused naming it.  Rows past those received are untouched."""
    from deepep import _lib
    lib, conn = buf._conn.lib, buf._conn
    x, idx, w = tokens()
    rows = buf.sizes["recv_rows"]
    rx = torch.empty(rows, 128, dtype=torch.bfloat16, device=DEV)
    rw = torch.empty(rows, 2, dtype=torch.float32, device=DEV)
    cnt = torch.empty(buf.num_local_experts, dtype=torch.int32, device=DEV)
    wide = torch.full((rows, 2), -7, dtype=torch.int64, device=DEV)
    narrow = torch.full((rows, 2), -7, dtype=torch.int32, device=DEV)
    nrecv = ctypes.c_uint32()
    h = ctypes.c_void_p()
    assert lib.dep_handle_new(conn.ptr, ctypes.byref(h)) == 0
    stream = None if conftest.BACKEND == "host" else torch.cuda.current_stream().cuda_stream
    a = _lib.DispatchArgs(x.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, w.data_ptr(), 4,
                          rx.data_ptr(), wide.data_ptr(), rw.data_ptr(), cnt.data_ptr(),
                          ctypes.addressof(nrecv))
    try:
        a.recv_index_type = _lib.INDEX_I64
        assert lib.dep_dispatch(conn.ptr, ctypes.byref(a), h, stream) == 0, conn.errmsg()
        # One rank: every token received once, in order, its ids local ids already.
        assert nrecv.value == 4 and torch.equal(wide[:4], idx) and bool((wide[4:] == -7).all())
        a.recv_topk_idx = narrow.data_ptr()
        a.size = _lib.DispatchArgs.recv_index_type.offset  # the 0.3.0 sizeof
        a.reserved = 0xdeadbeef
        assert lib.dep_dispatch(conn.ptr, ctypes.byref(a), h, stream) == 0, conn.errmsg()
        assert torch.equal(narrow[:4], idx.int()) and bool((narrow[4:] == -7).all())
        a.size, a.reserved, a.recv_index_type = ctypes.sizeof(a), 0, 5
        assert lib.dep_dispatch(conn.ptr, ctypes.byref(a), h, stream) == _lib.ERR_INVALID
        assert "recv_index_type 5 is neither 0 nor DEP_INDEX_I32" in conn.errmsg()
    finally:
        lib.dep_handle_free(h)
    # The binding's own ids are int64 as DeepEP's, its calls in step after the refusal.
    _, ri, _, counts, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    assert ri.dtype == torch.int64 and torch.equal(ri, idx) and counts == [2, 2, 2, 2]


def test_dispatch_leaves_its_counts_on_the_host_and_a_caller_of_the_0_4_0_struct_is_served(buf):
    """recv_count_per_expert_host (0.4.1): a dispatch that waits copies its counts there as
    it returns (on cuda behind the kernels, before its one synchronisation), exactly
    num_local_experts of them; a caller of the 0.4.0 struct, whose size ends where the field
    begins and whose tail padding (reserved2) it may leave unset, is served as before and its
    memory past its size is not read; with num_worst_tokens it is refused naming it and the
    host memory is left as it was."""
    from deepep import _lib
    lib, conn = buf._conn.lib, buf._conn
    x, idx, w = tokens()
    rows, L = buf.sizes["recv_rows"], buf.num_local_experts
    rx = torch.empty(rows, 128, dtype=torch.bfloat16, device=DEV)
    ri = torch.empty(rows, 2, dtype=torch.int64, device=DEV)
    rw = torch.empty(rows, 2, dtype=torch.float32, device=DEV)
    cnt = torch.full((L,), -3, dtype=torch.int32, device=DEV)
    host = (ctypes.c_int32 * (L + 2))()
    nrecv = ctypes.c_uint32()
    h = ctypes.c_void_p()
    assert lib.dep_handle_new(conn.ptr, ctypes.byref(h)) == 0
    stream = None if conftest.BACKEND == "host" else torch.cuda.current_stream().cuda_stream
    a = _lib.DispatchArgs(x.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, w.data_ptr(), 4,
                          rx.data_ptr(), ri.data_ptr(), rw.data_ptr(), cnt.data_ptr(),
                          ctypes.addressof(nrecv))
    a.recv_index_type = _lib.INDEX_I64
    a.recv_count_per_expert_host = ctypes.addressof(host)
    try:
        host[:] = [-7] * (L + 2)
        assert lib.dep_dispatch(conn.ptr, ctypes.byref(a), h, stream) == 0, conn.errmsg()
        # One rank, 4 tokens each naming experts t % 4 and (t + 1) % 4: 2 (row, k) pairs each.
        assert host[:] == [2] * L + [-7, -7] and cnt.tolist() == [2] * L
        a.expert_alignment = 3
        assert lib.dep_dispatch(conn.ptr, ctypes.byref(a), h, stream) == 0, conn.errmsg()
        assert host[:] == [3] * L + [-7, -7]
        a.expert_alignment = 0
        host[:] = [-7] * (L + 2)
        a.size = _lib.DispatchArgs.recv_count_per_expert_host.offset  # the 0.4.0 sizeof
        a.reserved2 = 0xdeadbeef
        assert lib.dep_dispatch(conn.ptr, ctypes.byref(a), h, stream) == 0, conn.errmsg()
        assert host[:] == [-7] * (L + 2) and nrecv.value == 4 and cnt.tolist() == [2] * L
        a.size, a.reserved2, a.num_worst_tokens, a.num_recv = ctypes.sizeof(a), 0, rows, None
        assert lib.dep_dispatch(conn.ptr, ctypes.byref(a), h, stream) == _lib.ERR_INVALID
        assert "recv_count_per_expert_host is not written with num_worst_tokens" in \
            conn.errmsg()
        assert host[:] == [-7] * (L + 2)
    finally:
        lib.dep_handle_free(h)
    # The binding's counts, in step after the refusal: a list of ints of its own per call
    # (the host scratch they are read from is the next call's).
    _, _, _, counts, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    assert counts == [2] * L and type(counts) is list and {type(c) for c in counts} == {int}
    one = torch.full_like(idx, -1)
    one[:, 0] = 1
    _, _, _, other, _, _ = buf.dispatch(x, topk_idx=one, topk_weights=w)
    assert other == [0, 4, 0, 0] and counts == [2] * L


def test_a_handle_in_a_torch_tensor_carries_a_dispatch_and_its_combine(buf):
    """dep_handle_new_in (0.4.0), called as the binding calls it in a CUDA-graph capture: the
    handle's arrays in a torch tensor of dep_handle_bytes on the Buffer's device (aligned by
    hand here: torch's CPU allocations are only 64-byte aligned), a dispatch and its combine
    through it, the handle's arrays written there and the bytes around them untouched;
    misaligned or short memory is refused saying what to do."""
    from deepep import _lib
    lib, conn = buf._conn.lib, buf._conn
    n = ctypes.c_size_t()
    assert lib.dep_handle_bytes(conn.ptr, ctypes.byref(n)) == 0, conn.errmsg()
    n, guard = n.value, 512
    assert n > 0 and n % 256 == 0
    mem = torch.full((2 * guard + n + 256,), 0xa5, dtype=torch.uint8, device=DEV)
    at = guard + (-(mem.data_ptr() + guard)) % 256
    base = mem.data_ptr() + at
    h = ctypes.c_void_p()
    assert lib.dep_handle_new_in(conn.ptr, base + 8, n, ctypes.byref(h)) == _lib.ERR_INVALID
    assert "is not 256-byte aligned (DEP_HANDLE_ALIGN)" in conn.errmsg() and not h.value
    assert lib.dep_handle_new_in(conn.ptr, base, n - 1, ctypes.byref(h)) == _lib.ERR_INVALID
    assert "is less than a handle of this job takes" in conn.errmsg() and not h.value
    assert lib.dep_handle_new_in(conn.ptr, base, n, ctypes.byref(h)) == 0, conn.errmsg()
    x = (torch.arange(4 * 128) % 61 / 8 - 3).view(4, 128).bfloat16().to(DEV)
    _, idx, w = tokens()
    rows = buf.sizes["recv_rows"]
    rx = torch.empty(rows, 128, dtype=torch.bfloat16, device=DEV)
    ri = torch.empty(rows, 2, dtype=torch.int64, device=DEV)
    rw = torch.empty(rows, 2, dtype=torch.float32, device=DEV)
    cnt = torch.empty(buf.num_local_experts, dtype=torch.int32, device=DEV)
    out = torch.empty_like(x)
    nrecv = ctypes.c_uint32()
    stream = None if conftest.BACKEND == "host" else torch.cuda.current_stream().cuda_stream
    a = _lib.DispatchArgs(x.data_ptr(), idx.data_ptr(), _lib.INDEX_I64, w.data_ptr(), 4,
                          rx.data_ptr(), ri.data_ptr(), rw.data_ptr(), cnt.data_ptr(),
                          ctypes.addressof(nrecv))
    a.recv_index_type = _lib.INDEX_I64
    c = _lib.CombineArgs(rx.data_ptr(), out.data_ptr())
    try:
        assert lib.dep_dispatch(conn.ptr, ctypes.byref(a), h, stream) == 0, conn.errmsg()
        assert lib.dep_combine(conn.ptr, ctypes.byref(c), h, stream) == 0, conn.errmsg()
    finally:
        lib.dep_handle_free(h)  # the tensor's memory stays the tensor's
    # One rank: every token received once, so the combine gives x back.
    assert nrecv.value == 4 and torch.equal(rx[:4], x) and torch.equal(out, x)
    assert bool((mem[at:at + n] != 0xa5).any()), "the handle's arrays are not in the tensor"
    assert bool((mem[:at] == 0xa5).all()) and bool((mem[at + n:] == 0xa5).all())


def test_status_and_attach_structs_carry_their_sizes(buf):
    """dep_status lays its result out in the mirrors' sizes and says what it filled; the
    attach structs carry their size too (AttachArgs is checked by every attach)."""
    from deepep import _lib
    lib, conn = buf._conn.lib, buf._conn
    st = ctypes.POINTER(_lib.Status)()
    assert lib.dep_status(conn.ptr, ctypes.byref(st)) == 0
    try:
        s = st.contents
        assert (s.size, s.device_size, s.job_size) == (
            ctypes.sizeof(_lib.Status), ctypes.sizeof(_lib.StatusDevice),
            ctypes.sizeof(_lib.StatusJob))
        assert s.num_jobs >= 1 and s.jobs[0].job_id
    finally:
        lib.dep_status_free(st)
    t = _lib.AttachTimes()
    assert lib.dep_attach_times(conn.ptr, ctypes.byref(t)) == 0 and t.size == ctypes.sizeof(t)
    t.size = 0
    assert lib.dep_attach_times(conn.ptr, ctypes.byref(t)) == _lib.ERR_INVALID
    assert "sizeof(struct dep_attach_times)" in conn.errmsg()
    assert set(buf.attach_times()) == {"total_ms", "wait_ms", "map_ms", "setup_ms", "warmup_ms"}


def test_the_sizes_a_caller_allocates_for_come_from_the_library(daemon):
    from deepep import _lib
    lib = _lib.load()
    sh = _lib.JobShape(4096, 7168, 256, 8, _lib.DTYPE_BF16, 0)
    out = _lib.ShapeSizes()
    assert lib.dep_shape_sizes(None, ctypes.byref(sh), 8, ctypes.byref(out)) == 0
    assert (out.max_ll_tokens_per_rank, out.local_experts, out.scale_groups, out.recv_rows,
            out.ll_recv_rows) == (256, 32, 56, 8 * 4096, 8 * 256)
    assert out.slab_bytes > 0
    sh.hidden = 100
    assert lib.dep_shape_sizes(None, ctypes.byref(sh), 8, ctypes.byref(out)) == _lib.ERR_INVALID
    b = one_rank(daemon, **SHAPE)
    assert b.sizes["recv_rows"] == 8 and b.sizes["ll_recv_rows"] == 8
    b.destroy()


def test_a_low_latency_handle_is_not_a_dispatch_handle(buf):
    x, idx, w = tokens()
    recv, _, lh, _, _ = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    with pytest.raises(ValueError, match="pass the matching dispatch's"):
        buf.combine(x, lh)


def test_destroy_is_idempotent_and_ends_the_buffer(daemon):
    b = one_rank(daemon, **SHAPE)
    b.destroy()
    b.destroy()
    x, idx, w = tokens()
    with pytest.raises(deepep.Error, match="destroyed"):
        b.dispatch(x, topk_idx=idx, topk_weights=w)


def test_the_shape_is_taken_from_the_first_calls_that_supply_it(daemon):
    b = one_rank(daemon, max_tokens_per_rank=8)
    x, idx, w = tokens()
    # The layout needs no hidden (Megatron asks for it first): computed before the attach.
    assert b.get_dispatch_layout(idx, 4)[0].tolist() == [4]
    assert not b.attached
    recv_x, _, _, counts, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w,
                                            num_tokens_per_expert=torch.zeros(4, dtype=torch.int32,
                                                                              device=DEV))
    assert b.attached and (b.hidden, b.num_experts, b.num_topk) == (128, 4, 2)
    assert counts == [2, 2, 2, 2] and b.get_dispatch_layout(idx, 4)[0].tolist() == [4]
    b.destroy()


def test_llm_call_shapes_and_hook(buf):
    x, idx, w = tokens()
    recv, count, h, ev, hook = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=True,
                                                        async_finish=True)
    q, s = recv
    assert q.shape == (4, 8, 128) and s.shape == (4, 8, 1) and q.dtype == deepep.fp8_dtype
    assert count.dtype == torch.int32 and ev.event is not None and hook() is None
    ev.current_stream_wait()
    buf.clean_low_latency_buffer(8, 128, 4)
    with pytest.raises(ValueError, match="hidden"):
        buf.clean_low_latency_buffer(8, 256, 4)


# ---- deep_ep -----------------------------------------------------------------------

def import_compat():
    """python/deep_ep_compat imported as deep_ep, as an opt-in install lays it out."""
    return ranks.import_compat()


def test_deep_ep_imports_as_megatron_and_sglang_import_it(daemon):
    import_compat()
    from deep_ep import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401
    from deep_ep.utils import EventHandle, EventOverlap as EO2
    assert EO2 is EventOverlap and topk_idx_t is torch.int64 and EventHandle is deepep.EventHandle
    # Megatron's get_buffer: Buffer(group, num_nvl_bytes, num_rdma_bytes), then its attributes.
    b = Buffer(None, 1 << 20, 0, low_latency_mode=False, num_qps_per_rank=24,
               allow_mnnvl=True, explicitly_destroy=True, some_fork_only_kwarg=1,
               job_id="c-" + uuid.uuid4().hex[:8],
               rank=0, world_size=1, socket=daemon, **SHAPE)
    assert (b.group, b.num_nvl_bytes, b.num_rdma_bytes, b.group_size) == (None, 1 << 20, 0, 1)
    assert b.ignored_kwargs == {"some_fork_only_kwarg": 1}
    x, idx, w = tokens()
    per_rank, per_rdma, per_expert, in_rank, ev = b.get_dispatch_layout(
        idx, 4, previous_event=None, async_finish=True, allocate_on_comm_stream=True)
    recv_x, recv_idx, recv_w, counts, handle, after = b.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, previous_event=ev, async_finish=True,
        allocate_on_comm_stream=True)
    after.current_stream_wait()
    assert torch.tensor(counts).tolist() == [2, 2, 2, 2]
    # DeepEP's intranode handle: a 6-tuple whose [0][i][rank] ends source i's rows.
    assert isinstance(handle, tuple) and len(handle) == 6
    assert isinstance(handle.handle, deepep.Handle) and handle[0].tolist() == [[4]]
    assert handle[3].shape == (4,) and torch.equal(handle[4], in_rank)
    assert handle[5].view(-1).tolist() == [0, 1, 2, 3]
    out, _, ev = b.combine(recv_x, handle=handle, async_finish=True, previous_event=after,
                           allocate_on_comm_stream=True)
    assert torch.equal(out, x)  # one rank received each token once
    # Megatron's backward of dispatch: combine(grad, handle, topk_weights=grad_probs.float()).
    grad, grad_w, ev = b.combine(recv_x, handle, topk_weights=recv_w.float(), previous_event=ev,
                                 async_finish=True, allocate_on_comm_stream=True)
    assert torch.equal(grad, x) and torch.equal(grad_w, w)
    # Megatron's backward of combine: dispatch(grad, handle=ctx.handle) (cached mode).
    g, n1, n2, n3, n4, ev = b.dispatch(grad, handle=handle, previous_event=ev, async_finish=True,
                                       allocate_on_comm_stream=True)
    assert torch.equal(g, recv_x) and (n1, n2, n3, n4) == (None, None, None, None)
    # SGLang's normal path with DeepGEMM: an FP8 (values, scales) tuple, expert_alignment=128,
    # config=; then combine without weights.
    q = torch.randint(0, 256, (4, 128), dtype=torch.uint8, device=DEV).view(deepep.fp8_dtype)
    sc = torch.rand(4, 1, device=DEV)
    ev = Buffer.capture()
    (rq, rsc), _, _, counts, h2, ev = b.dispatch(
        (q, sc), topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=ev,
        async_finish=True, allocate_on_comm_stream=True, expert_alignment=128,
        config=Buffer.get_dispatch_config(1))
    ev.current_stream_wait()
    assert counts == [128] * 4 and torch.equal(rq.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rsc, sc)
    out, _, _ = b.combine(recv_x, h2, config=Buffer.get_combine_config(1))
    assert torch.equal(out, x)
    b.destroy()
    for name in ("deep_ep.utils", "deep_ep"):
        sys.modules.pop(name, None)

