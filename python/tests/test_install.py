"""The README's promise for the Python package: the install the README prints works as typed
on Debian 12 (whose Python refuses a plain `pip install`, PEP 668), offline, and the README's
example then runs a dispatch and combine against a real daemon; building the package leaves
nothing in the tree, and the `deep_ep` module is shipped only by a build that asks for it.

The install runs the README's own ```sh block (the Python section's block with `pip install`)
with bash, in a temporary directory laid out as the repository root the block expects
(python/, a copy, as from a fresh checkout; build/, a link to the build; run/deepepd.sock, a
link to the test's daemon) and with HOME there, so that its ~ is the test's own.  The example,
taken from the README's first ```python block, runs with the environment's interpreter, which
must import deepep from the environment and not from the source tree.  The installed
package's version is deepep.h's.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

from conftest import BACKEND, BUILD, REPO

PIP_ENV = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")


def _readme() -> str:
    return open(os.path.join(REPO, "README.md")).read()


def _readme_example() -> str:
    m = re.search(r"```python\n(.*?)```", _readme(), re.S)
    assert m is not None, "README.md has no ```python block (the Python section's example)"
    return m.group(1)


def _readme_install() -> str:
    """The Python section's ```sh block that installs the package."""
    m = re.search(r"\n## Python\n(.*?)\n## ", _readme(), re.S)
    assert m is not None, "README.md has no section \"## Python\""
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", m.group(1), re.S) if "pip install" in b]
    assert blocks, "README.md's Python section has no ```sh block with `pip install`"
    return blocks[0]


def _header_version() -> str:
    text = open(os.path.join(REPO, "include", "deepep.h")).read()
    m = re.search(r'#define DEP_VERSION_STRING "([^"]+)"', text)
    assert m is not None, "deepep.h defines no DEP_VERSION_STRING"
    return m.group(1)


def _copy_package(dest: str) -> str:
    """A copy of python/ as a fresh checkout has it (no build output, no tests) at dest."""
    shutil.copytree(os.path.join(REPO, "python"), dest,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    return dest


def _wheel(src: str, out: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
                           "--no-index", "--no-deps", "-w", out, src],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(src))


def _wheel_files(out: str) -> list:
    wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert len(wheels) == 1, f"pip wheel made {wheels} in {out}, not one wheel"
    with zipfile.ZipFile(os.path.join(out, wheels[0])) as z:
        return z.namelist()


def test_the_readmes_install_as_typed_then_the_readmes_example_runs(daemon):
    if BACKEND != "host":
        pytest.skip("the README's example uses CPU tensors: it runs on the host backend")
    with tempfile.TemporaryDirectory(prefix="deepep-pip.") as d:
        _copy_package(os.path.join(d, "python"))
        os.symlink(BUILD, os.path.join(d, "build"))
        os.mkdir(os.path.join(d, "run"))
        os.symlink(daemon, os.path.join(d, "run", "deepepd.sock"))
        # The example's job id is fixed; a second run of the suite on the same daemon must
        # not meet the first's, so each run is its own job.
        example = _readme_example().replace('"example-py"', f'"example-py-{os.getpid()}"')
        probe = ("import deepep, os, sys\n"
                 "assert os.path.dirname(deepep.__file__).startswith(sys.argv[1]), "
                 "deepep.__file__\n"
                 "print('version', deepep.__version__)\n")
        with open(os.path.join(d, "example.py"), "w") as f:
            f.write(probe + example)
        # The README's lines as they are, then its example with the environment's interpreter
        # (the README says to run trainers with it), in the environment the lines exported.
        script = ("set -e\n" + _readme_install() +
                  '\nexec ~/deepep-venv/bin/python example.py "$(realpath ~/deepep-venv)"\n')
        env = {k: v for k, v in PIP_ENV.items()
               if k not in ("PYTHONPATH", "DEEPEP_CLIENT_LIB", "DEEPEPD_SOCKET", "VIRTUAL_ENV")}
        env["HOME"] = d
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600,
                           env=env, cwd=d)
        assert r.returncode == 0, \
            f"the README's install, then its example, failed:\n{r.stdout}\n{r.stderr}"
        lines = r.stdout.strip().splitlines()
        versions = [ln for ln in lines if ln.startswith("version ")]
        assert versions == [f"version {_header_version()}"], \
            f"the installed package's version is not deepep.h's: {versions}"
        assert lines[-1] == "[2, 2, 2, 2] True", \
            f"the README's example printed {lines[-1]!r}, not what its comment says"
        # The install built in a directory of its own, not beside the sources.
        left = sorted(set(os.listdir(os.path.join(d, "python"))) &
                      {"build", "deepep.egg-info"})
        assert left == [], f"installing left {left} in python/"


def test_building_leaves_no_build_output_in_the_tree():
    with tempfile.TemporaryDirectory(prefix="deepep-wheel.") as d:
        src = _copy_package(os.path.join(d, "python"))
        before = sorted(os.listdir(src))
        r = _wheel(src, os.path.join(d, "w"), PIP_ENV)
        assert r.returncode == 0, f"pip wheel ./python failed:\n{r.stdout}\n{r.stderr}"
        after = sorted(os.listdir(src))
        assert after == before, f"building the wheel left {sorted(set(after) - set(before))} " \
                                "in python/"


def test_deep_ep_is_shipped_only_by_a_build_that_asks_whatever_was_built_before():
    with tempfile.TemporaryDirectory(prefix="deepep-wheel.") as d:
        src = _copy_package(os.path.join(d, "python"))
        opt_in = dict(PIP_ENV, DEEPEP_INSTALL_DEEP_EP="1")
        r = _wheel(src, os.path.join(d, "w1"), opt_in)
        assert r.returncode == 0, f"DEEPEP_INSTALL_DEEP_EP=1 pip wheel failed:\n{r.stderr}"
        shipped = _wheel_files(os.path.join(d, "w1"))
        assert "deep_ep/__init__.py" in shipped, \
            "DEEPEP_INSTALL_DEEP_EP=1 built a wheel without deep_ep/"
        # deep_ep.utils as DeepEP 2.x's scripts import it, a package with its modules.
        utils = {f"deep_ep/utils/{m}.py" for m in ("__init__", "envs", "math", "testing")}
        assert utils <= set(shipped), f"the wheel lacks {sorted(utils - set(shipped))}"
        # A real DeepEP where the build can import it: the plain build after the opt-in
        # one must neither ship deep_ep/ over it nor refuse (it installs no deep_ep).
        real = os.path.join(d, "real")
        os.makedirs(os.path.join(real, "deep_ep"))
        with open(os.path.join(real, "deep_ep", "__init__.py"), "w") as f:
            f.write('"""DeepEP itself."""\n')
        plain = dict(PIP_ENV, PYTHONPATH=real)
        plain.pop("DEEPEP_INSTALL_DEEP_EP", None)
        r = _wheel(src, os.path.join(d, "w2"), plain)
        assert r.returncode == 0, f"a plain pip wheel failed:\n{r.stdout}\n{r.stderr}"
        shipped = [f for f in _wheel_files(os.path.join(d, "w2")) if f.startswith("deep_ep/")]
        assert shipped == [], f"a plain build after an opt-in one shipped {shipped}"
        # And an opt-in build after those refuses to go over the real DeepEP.
        r = _wheel(src, os.path.join(d, "w3"), dict(plain, DEEPEP_INSTALL_DEEP_EP="1"))
        assert r.returncode != 0 and "already installed" in r.stdout + r.stderr, \
            f"an opt-in build went over a real DeepEP:\n{r.stdout}\n{r.stderr}"


def test_a_missing_library_says_which_package_provides_it():
    # $DEEPEP_CLIENT_LIB is an explicit choice that is never silently replaced, so a path
    # with no library behind it is a missing library whatever the system has installed.
    with tempfile.TemporaryDirectory(prefix="deepep-nolib.") as d:
        code = ("import deepep\n"
                "try:\n"
                "    deepep.Buffer(job_id='nolib', rank=0, world_size=1, hidden=128,\n"
                "                  num_experts=4, num_topk=2, max_tokens_per_rank=8)\n"
                "except OSError as e:\n"
                "    print(e)\n"
                "else:\n"
                "    raise SystemExit('Buffer(...) without the library did not raise')\n")
        env = dict(os.environ, DEEPEP_CLIENT_LIB=os.path.join(d, "libdeepep-client.so.0"),
                   PYTHONPATH=os.path.join(REPO, "python"))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env=env, cwd=d)
        assert r.returncode == 0, f"import deepep without the library failed:\n{r.stderr}"
        msg = r.stdout
        for words in ("libdeepep-client0", "make install", "carries no native library"):
            assert words in msg, f"the missing library's message does not say {words!r}: {msg}"
