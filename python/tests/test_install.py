"""The README's promise for the Python package: `pip install ./python` works offline, and the
README's example then runs a dispatch and combine against a real daemon.

The package is installed with pip (no index, no build isolation: Debian's setuptools) into a
temporary directory from a copy of python/, and the example, taken from the README's first ```python block, runs in
a fresh interpreter that sees that directory and not the source tree.  The installed
package's version is deepep.h's.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import BACKEND, REPO


def _readme_example() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    m = re.search(r"```python\n(.*?)```", text, re.S)
    assert m is not None, "README.md has no ```python block (the Python section's example)"
    return m.group(1)


def _header_version() -> str:
    text = open(os.path.join(REPO, "client", "deepep.h")).read()
    m = re.search(r'#define DEP_VERSION_STRING "([^"]+)"', text)
    assert m is not None, "deepep.h defines no DEP_VERSION_STRING"
    return m.group(1)


def test_pip_install_then_the_readme_example_runs(daemon):
    if BACKEND != "host":
        pytest.skip("the README's example uses CPU tensors: it runs on the host backend")
    with tempfile.TemporaryDirectory(prefix="deepep-pip.") as d:
        target = os.path.join(d, "site")
        # From a copy, as from a fresh checkout: setuptools writes build/ and egg-info
        # beside the sources, which must not be the repository's.
        src = os.path.join(d, "src")
        shutil.copytree(os.path.join(REPO, "python"), src,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                      "tests"))
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation",
                            "--no-index", "--no-deps", "--target", target, src],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"), cwd=d)
        assert r.returncode == 0, f"pip install ./python failed:\n{r.stdout}\n{r.stderr}"
        env = dict(os.environ, PYTHONPATH=target, DEEPEPD_SOCKET=daemon)
        # The example's job id is fixed; a second run of the suite on the same daemon must
        # not meet the first's, so each run is its own job.
        example = _readme_example().replace('"example-py"', f'"example-py-{os.getpid()}"')
        probe = ("import deepep, os, sys\n"
                 "assert os.path.dirname(deepep.__file__).startswith(sys.argv[1]), "
                 "deepep.__file__\n"
                 "print('version', deepep.__version__)\n")
        r = subprocess.run([sys.executable, "-c", probe + example, target],
                           capture_output=True, text=True, timeout=120, env=env, cwd=d)
        assert r.returncode == 0, f"the README's example failed:\n{r.stdout}\n{r.stderr}"
        lines = r.stdout.strip().splitlines()
        assert lines[0] == f"version {_header_version()}", \
            f"the installed package's version is not deepep.h's: {lines[0]}"
        assert lines[-1] == "[2, 2, 2, 2] True", \
            f"the README's example printed {lines[-1]!r}, not what its comment says"
