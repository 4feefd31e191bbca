"""Fixtures: a real deepepd (host backend, temporary socket, small pool) from the build.

The binaries are $DEP_BUILD's (the Makefile sets it), else the repository's
build/.  The library is $DEEPEP_CLIENT_LIB, else the build's.
"""
import ctypes
import os
import random
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


def daemon_state(sock: str) -> str:
    """The daemon's state ("" when none answers), through the library."""
    from deepep import _lib
    lib = _lib.load()
    c = ctypes.c_void_p()
    if lib.dep_client_new(ctypes.byref(c)) != 0:
        return ""
    try:
        if lib.dep_connect(c, sock.encode()) != 0:
            return ""
        st = ctypes.POINTER(_lib.Status)()
        if lib.dep_status(c, ctypes.byref(st)) != 0:
            return ""
        s = st.contents.state.decode()
        lib.dep_status_free(st)
        return s
    finally:
        lib.dep_client_free(c)


@pytest.fixture(scope="session")
def daemon():
    """The socket of a deepepd started for the session; stopped (SIGTERM) at its end."""
    exe = os.path.join(BUILD, "deepepd")
    if not os.access(exe, os.X_OK):
        pytest.fail(f"no deepepd at {exe}: build first (make), or set DEP_BUILD")
    d = tempfile.mkdtemp(prefix="deepep-py.")
    sock, conf, log = (os.path.join(d, n) for n in ("d.sock", "deepepd.yaml", "deepepd.log"))
    with open(conf, "w") as f:
        f.write(f"socket:\n  path: {sock}\n  mode: 0600\nbackend: host\n"
                "pool:\n  host_size: 128MiB\n  chunk_size: 2MiB\n")
    with open(log, "w") as logf:
        p = subprocess.Popen([exe, "--backend", "host", "-s", sock, "-c", conf],
                             stdout=logf, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while daemon_state(sock) in ("", "starting"):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail("deepepd did not start; its log:\n" + open(log).read())
        time.sleep(0.02)
    yield sock
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


def pytest_report_header(config):
    return [f"deepep: build {BUILD}, library {os.environ['DEEPEP_CLIENT_LIB']}",
            f"deepep: seed {SEED} (rerun with DEEPEP_TEST_SEED={SEED})"]
