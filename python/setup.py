"""The package list of the deepep distribution (the rest is in pyproject.toml).

The ``deep_ep`` compatibility module is installed only when asked:
``DEEPEP_INSTALL_DEEP_EP=1 pip install ./python``.  It is never installed
over a real DeepEP: when ``deep_ep`` already imports from somewhere else
(a DeepEP install, not this module), the build refuses instead.
"""
import importlib.util
import os

from setuptools import setup

packages = ["deepep"]
package_dir = {"deepep": "deepep"}
if os.environ.get("DEEPEP_INSTALL_DEEP_EP") == "1":
    spec = importlib.util.find_spec("deep_ep")
    ours = "DeepEP's module names over deepepd"
    if spec is not None and spec.origin and ours not in open(spec.origin).read():
        raise SystemExit(f"deepep: a deep_ep is already installed at {spec.origin}; the "
                         "compatibility module is not installed over it (uninstall DeepEP first)")
    packages.append("deep_ep")
    package_dir["deep_ep"] = "deep_ep_compat"

setup(packages=packages, package_dir=package_dir)
