"""The package list of the deepep distribution (the rest is in pyproject.toml).

The ``deep_ep`` compatibility module is installed only when asked:
``DEEPEP_INSTALL_DEEP_EP=1 pip install ./python``.  It is never installed
over a real DeepEP: when ``deep_ep`` already imports from somewhere else
(a DeepEP install), the build refuses instead.
"""
import importlib.util
import os

from setuptools import setup

packages = ["deepep"]
package_dir = {"deepep": "deepep"}
if os.environ.get("DEEPEP_INSTALL_DEEP_EP") == "1":
    spec = importlib.util.find_spec("deep_ep")
    if spec is not None and "deep_ep_compat" not in str(spec.origin) and \
            not os.path.exists(os.path.join(os.path.dirname(str(spec.origin)), "deepepd_compat")):
        raise SystemExit(f"deepep: a deep_ep is already installed at {spec.origin}; the "
                         "compatibility module is not installed over it (uninstall DeepEP first)")
    packages.append("deep_ep")
    package_dir["deep_ep"] = "deep_ep_compat"

setup(packages=packages, package_dir=package_dir,
      package_data={"deep_ep": ["deepepd_compat"]} if "deep_ep" in packages else {})
