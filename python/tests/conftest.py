"""Fixtures: a real deepepd (temporary socket, small pool) from the build.

The backend is $DEP_TEST_BACKEND's, as for the C suite: host (the default;
CPU tensors) or cuda (tensors on GPU 0, which every rank process shares: run
under MPS, DEVICE.md).  Tests that need the cuda backend skip, saying so,
on the host backend.  The binaries are $DEP_BUILD's (the Makefile sets it),
else the repository's build/.  The library is $DEEPEP_CLIENT_LIB, else the
build's.
"""
import ctypes
import os
import pickle
import random
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("DEP_BUILD") or os.path.join(REPO, "build")
os.environ.setdefault("DEEPEP_CLIENT_LIB", os.path.join(BUILD, "libdeepep-client.so.0"))
sys.path.insert(0, HERE)
BACKEND = os.environ.get("DEP_TEST_BACKEND") or "host"
if BACKEND not in ("host", "cuda"):
    raise SystemExit(f"DEP_TEST_BACKEND={BACKEND!r}: use host or cuda")
#: The device of every rank's tensors.
DEVICE = "cuda:0" if BACKEND == "cuda" else "cpu"


def daemon_status(sock: str, read):
    """read(the daemon's dep_status result) through the library, or None when no daemon
    answers at sock (or its dep_status fails)."""
    from deepep import _lib
    lib = _lib.load()
    c = ctypes.c_void_p()
    if lib.dep_client_new(ctypes.byref(c)) != 0:
        return None
    try:
        if lib.dep_connect(c, sock.encode()) != 0:
            return None
        st = ctypes.POINTER(_lib.Status)()
        if lib.dep_status(c, ctypes.byref(st)) != 0:
            return None
        try:
            return read(st.contents)
        finally:
            lib.dep_status_free(st)
    finally:
        lib.dep_client_free(c)


def daemon_state(sock: str) -> str:
    """The daemon's state ("" when none answers), through the library."""
    return daemon_status(sock, lambda st: st.state.decode()) or ""


@pytest.fixture(scope="session")
def daemon():
    """The socket of a deepepd started for the session; stopped (SIGTERM) at its end.
    $DEP_TEST_SOCKET names a running daemon to use instead (of the backend the run asks for:
    on the GPU machine one started outside MPS, before the MPS server, as DEVICE.md says)."""
    given = os.environ.get("DEP_TEST_SOCKET")
    if given:
        if daemon_state(given) in ("", "starting"):
            pytest.fail(f"$DEP_TEST_SOCKET={given}: no deepepd answers there")
        yield given
        return
    exe = os.path.join(BUILD, "deepepd")
    if not os.access(exe, os.X_OK):
        pytest.fail(f"no deepepd at {exe}: build first (make), or set DEP_BUILD")
    if BACKEND == "cuda":
        import torch
        if not torch.cuda.is_available():
            pytest.fail("DEP_TEST_BACKEND=cuda but torch sees no GPU "
                        f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    d = tempfile.mkdtemp(prefix="deepep-py.")
    sock, conf, log = (os.path.join(d, n) for n in ("d.sock", "deepepd.yaml", "deepepd.log"))
    pool = "pool:\n  host_size: 128MiB\n  chunk_size: 2MiB\n" if BACKEND == "host" else \
        "pool:\n  size_per_device: 8GiB\n  host_size: 64MiB\n  chunk_size: 64MiB\n"
    with open(conf, "w") as f:
        f.write(f"socket:\n  path: {sock}\n  mode: 0600\nbackend: {BACKEND}\n" + pool)
    with open(log, "w") as logf:
        p = subprocess.Popen([exe, "--backend", BACKEND, "-s", sock, "-c", conf],
                             stdout=logf, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while daemon_state(sock) in ("", "starting"):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail("deepepd did not start; its log:\n" + open(log).read())
        time.sleep(0.02)
    yield sock
    if os.environ.get("DEP_TEST_DAEMON_LOG"):
        with open(log) as src, open(os.environ["DEP_TEST_DAEMON_LOG"], "a") as dst:
            dst.write(src.read())
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    subprocess.run(["rm", "-rf", d], check=False)


# The seed of the random inputs: $DEEPEP_TEST_SEED, else a fresh one, printed in the header.
SEED = int(os.environ.get("DEEPEP_TEST_SEED") or random.SystemRandom().randrange(1 << 30))


@pytest.fixture(scope="session")
def seed():
    return SEED


@pytest.fixture(scope="session")
def device():
    """The torch.device of the backend's tensors."""
    import torch
    return torch.device(DEVICE)


@pytest.fixture
def cuda_only():
    """Skip, saying so, unless the suite runs against a cuda daemon."""
    if BACKEND != "cuda":
        pytest.skip("needs the cuda backend: DEP_TEST_BACKEND=cuda on a machine with a GPU "
                    "(this run is on the host backend)")


def pytest_report_header(config):
    import torch
    return [f"deepep: build {BUILD}, library {os.environ['DEEPEP_CLIENT_LIB']}",
            f"deepep: backend {BACKEND} (DEP_TEST_BACKEND), tensors on {DEVICE}, torch "
            f"{torch.__version__}" + (f", {torch.cuda.get_device_name(0)}"
                                      if BACKEND == "cuda" and torch.cuda.is_available() else ""),
            f"deepep: seed {SEED} (rerun with DEEPEP_TEST_SEED={SEED})"]


def spawn_ranks(fn, nprocs: int, args: tuple, d: str, timeout: float, what: str) -> list:
    """Run fn(rank, *args) in nprocs processes started by torch.multiprocessing.spawn (as
    DeepEP's tests start theirs), fail the test when they have not all ended within timeout
    seconds (a ceiling for a loaded machine, not a timing), and return what each one pickled
    into d/<rank>.pkl, by rank."""
    import torch.multiprocessing as tmp  # on use: torch-free tests import conftest too

    ctx = tmp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {what} did not finish within {timeout} s")
    out = []
    for r in range(nprocs):
        with open(os.path.join(d, f"{r}.pkl"), "rb") as f:
            out.append(pickle.load(f))
    return out


@pytest.fixture
def buf(daemon):
    """One rank's deepep.Buffer of onerank.SHAPE on the session's daemon, destroyed after."""
    import onerank
    b = onerank.one_rank(daemon, **onerank.SHAPE)
    yield b
    b.destroy()


def free_ports(n: int = 1) -> list:
    """n distinct TCP ports free on 127.0.0.1 now (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
