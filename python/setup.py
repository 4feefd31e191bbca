"""The package list of the deepep distribution (the rest is in pyproject.toml).

The ``deep_ep`` compatibility module is installed only when asked:
``DEEPEP_INSTALL_DEEP_EP=1 pip install ./python``.  It is never installed
over a real DeepEP: when ``deep_ep`` already imports from somewhere else
(a DeepEP install, not this module), the build refuses instead.

Every run of this file builds in a temporary directory of its own, removed at
exit, never in the source tree: setuptools would otherwise leave build/ and
deepep.egg-info/ beside the sources, and copy whatever an earlier build left
in build/lib into every later wheel, so that one build with
DEEPEP_INSTALL_DEEP_EP=1 made every later plain build ship deep_ep/ too.
"""
import atexit
import importlib.util
import os
import shutil
import tempfile

from setuptools import setup

packages = ["deepep"]
package_dir = {"deepep": "deepep"}
if os.environ.get("DEEPEP_INSTALL_DEEP_EP") == "1":
    spec = importlib.util.find_spec("deep_ep")
    ours = "DeepEP's module names over deepepd"
    if spec is not None and spec.origin and ours not in open(spec.origin).read():
        raise SystemExit(f"deepep: a deep_ep is already installed at {spec.origin}; the "
                         "compatibility module is not installed over it (uninstall DeepEP first)")
    # deep_ep.utils is a package of its own (DeepEP 2.x's test helpers): listed, or the
    # wheel ships deep_ep/ without it.
    packages += ["deep_ep", "deep_ep.utils"]
    package_dir["deep_ep"] = "deep_ep_compat"

scratch = tempfile.mkdtemp(prefix="deepep-build.")
atexit.register(shutil.rmtree, scratch, ignore_errors=True)

setup(packages=packages, package_dir=package_dir,
      options={"build": {"build_base": os.path.join(scratch, "build")},
               "egg_info": {"egg_base": scratch}})
