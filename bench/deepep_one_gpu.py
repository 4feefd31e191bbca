#!/usr/bin/python3
"""deepep_one_gpu — run DeepEP's own test scripts, unmodified, with all their ranks on one GPU.

    bench/deepep_one_gpu.py [--gpu N] SCRIPT [ARGS...]

DeepEP's tests (tests/test_intranode.py, tests/test_low_latency.py) start one process per
GPU with torch.multiprocessing.spawn, give each torch.cuda.set_device(local_rank), and join
an NCCL process group.  On one GPU (under MPS, so that the ranks' kernels run side by side)
NCCL refuses two ranks on one device, and cuda:1.. do not exist.  This launcher runs SCRIPT
with two mappings, installed in every Python process it starts (the spawned ranks too,
through a sitecustomize.py on PYTHONPATH), and nothing else:

- devices: every CUDA device index (torch.cuda.set_device, torch.cuda.device, and the
  device_id of init_process_group) is the one GPU, CUDA_VISIBLE_DEVICES=N (default 0);
- the process group's backend: NCCL (asked for by name, as the default, or as part of a
  "cpu:gloo,cuda:nccl" string) is gloo, and the collectives the scripts call on CUDA
  tensors (all_reduce, broadcast, all_gather, all_gather_into_tensor, all_to_all_single,
  barrier) go through host copies; bfloat16 is moved as its bytes, and summed in float32.

The scripts' asserts and arithmetic are not touched.  `deep_ep` is deepepd's (python/
deep_ep_compat, ahead of any installed DeepEP), `deepep` the repository's python/, and the
library and daemon are found as the binding finds them ($DEEPEP_CLIENT_LIB,
$DEEPEPD_SOCKET).  Start deepepd outside MPS first, then MPS (bench/mps.sh), then this.
"""
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
#: The environment variable that tells a process started by the launcher to map.
ENV = "DEEPEP_ONE_GPU"

_SITECUSTOMIZE = '''\
# Written by bench/deepep_one_gpu.py: the launcher's mappings in every Python process it
# starts, then the sitecustomize this one shadows (Debian has one).
import importlib.util as _u
import os as _os
import sys as _sys
_sys.path.insert(0, {bench!r})
import deepep_one_gpu as _m
_sys.path.remove({bench!r})
_m.install()
for _d in _sys.path:
    _p = _os.path.join(_d or ".", "sitecustomize.py")
    if _os.path.abspath(_d or ".") != _os.path.dirname(_os.path.abspath(__file__)) and \\
            _os.path.isfile(_p):
        _s = _u.spec_from_file_location("_shadowed_sitecustomize", _p)
        _s.loader.exec_module(_u.module_from_spec(_s))
        break
'''


# ---- the mappings ----------------------------------------------------------------------

def one_device(device):
    """Any CUDA device (an index, "cuda:i", "cuda", a torch.device) as the one GPU's: index
    0 of the visible devices (CUDA_VISIBLE_DEVICES names the one).  A negative index or None
    (torch's "no device") and non-CUDA devices are kept as they are."""
    import torch
    if device is None:
        return None
    if isinstance(device, int):
        return device if device < 0 else 0
    d = torch.device(device)
    if d.type != "cuda":
        return device
    return torch.device("cuda", 0) if not isinstance(device, str) else "cuda:0"


def one_backend(backend):
    """The process group's backend: gloo where NCCL was asked for (by name, as part of a
    per-device string such as "cpu:gloo,cuda:nccl", or as the default, None, which is NCCL
    for CUDA tensors); any other backend is kept."""
    if backend is None:
        return "gloo"
    name = str(backend).lower()
    return "gloo" if "nccl" in name else backend


class _Done:
    """The Work of a collective made synchronously (its host copy is back when it returns)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _host(t):
    """t on the host, bfloat16 as its bytes (gloo takes neither bfloat16 nor int16; sums are
    made apart)."""
    h = t.detach().cpu()
    import torch
    return h.contiguous().view(torch.uint8) if h.dtype == torch.bfloat16 else h


def _back(t, h):
    import torch
    t.copy_(h.view(torch.bfloat16) if t.dtype == torch.bfloat16 and h.dtype == torch.uint8
            else h)


def install():
    """Map devices and the backend in this process, as the module says (where $DEEPEP_ONE_GPU
    is set: the launcher sets it for SCRIPT and every process SCRIPT starts)."""
    if not os.environ.get(ENV):
        return
    import torch
    import torch.distributed as dist

    real_set_device = torch.cuda.set_device

    def set_device(device):
        return real_set_device(one_device(device))

    torch.cuda.set_device = set_device

    real_device = torch.cuda.device

    class device(real_device):  # torch.cuda.device(i), the context manager
        def __init__(self, dev):
            super().__init__(one_device(dev))

    torch.cuda.device = device

    real_init = dist.init_process_group

    def init_process_group(backend=None, *args, **kw):
        kw.pop("device_id", None)  # NCCL's eager init on a device; gloo has none
        return real_init(one_backend(backend), *args, **kw)

    dist.init_process_group = init_process_group

    real_new_group = dist.new_group

    def new_group(*args, **kw):
        if "backend" in kw:
            kw["backend"] = one_backend(kw["backend"])
        return real_new_group(*args, **kw)

    dist.new_group = new_group

    def collective(real, sums=False):
        """real(tensors..., rest) with its tensor (or list of tensors) arguments copied to
        the host and back where one is a CUDA tensor or bfloat16 (which gloo does not take:
        moved as its bits, summed in float32)."""
        def call(*args, **kw):
            async_op = kw.pop("async_op", False)
            if not any(_needs_host(a) for a in args):
                return real(*args, async_op=async_op, **kw)
            hosts = [[_host(t) for t in a] if isinstance(a, list) else
                     (_host(a) if _is_tensor(a) else a) for a in args]
            if sums and any(_is_tensor(a) and a.dtype == torch.bfloat16 for a in args):
                hosts = [a.detach().cpu().float() if _is_tensor(a) else a for a in args]
            real(*hosts, **kw)
            for a, h in zip(args, hosts):
                if isinstance(a, list):
                    for t, ht in zip(a, h):
                        _back(t, ht)
                elif _is_tensor(a):
                    if h.dtype == torch.float32 and a.dtype == torch.bfloat16:
                        a.copy_(h)
                    else:
                        _back(a, h)
            return _Done() if async_op else None
        return call

    dist.all_reduce = collective(dist.all_reduce, sums=True)
    dist.broadcast = collective(dist.broadcast)
    dist.all_gather = collective(dist.all_gather)
    real_all_gather = dist.all_gather

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        # As all_gather into the output's rows (gloo has no all_gather_into_tensor in every
        # torch), on host copies of CUDA tensors.
        out_h, in_h = _host(output), _host(input)
        parts = list(out_h.reshape(dist.get_world_size(group), -1).unbind(0))
        real_all_gather(parts, in_h.reshape(-1), group=group)
        _back(output, out_h)
        return _Done() if async_op else None

    dist.all_gather_into_tensor = all_gather_into_tensor
    dist.all_to_all_single = collective(dist.all_to_all_single)

    real_barrier = dist.barrier

    def barrier(group=None, async_op=False, device_ids=None):
        return real_barrier(group=group, async_op=async_op)  # device_ids: NCCL's

    dist.barrier = barrier


def _is_tensor(a):
    import torch
    return isinstance(a, torch.Tensor)


def _needs_host(a):
    """Whether a (a tensor or a list of them) is on CUDA or bfloat16."""
    import torch
    if isinstance(a, list):
        return any(_needs_host(t) for t in a)
    return _is_tensor(a) and (a.is_cuda or a.dtype == torch.bfloat16)


# ---- the launcher ------------------------------------------------------------------------

def environment(gpu: str, base: dict, site_dir: str) -> dict:
    """The environment SCRIPT runs in: the mapping switched on, the one GPU visible, the
    sitecustomize and deepepd's deep_ep and deepep first on PYTHONPATH."""
    env = dict(base)
    env[ENV] = "1"
    env["CUDA_VISIBLE_DEVICES"] = gpu
    path = [site_dir, os.path.join(REPO, "python")]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def site_dir() -> str:
    """A directory with the sitecustomize.py that installs the mappings and a deep_ep that is
    python/deep_ep_compat."""
    d = tempfile.mkdtemp(prefix="deepep-one-gpu.")
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE.format(bench=HERE))
    os.symlink(os.path.join(REPO, "python", "deep_ep_compat"), os.path.join(d, "deep_ep"))
    return d


def main(argv) -> int:
    gpu = "0"
    if argv[:1] == ["--gpu"] and len(argv) > 1:
        gpu, argv = argv[1], argv[2:]
    if not argv or argv[0].startswith("-"):
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    script = argv[0]
    if not os.path.isfile(script):
        sys.stderr.write(f"deepep_one_gpu: no script {script}\n")
        return 2
    env = environment(gpu, os.environ, site_dir())
    # The script's own directory first on sys.path, as `python SCRIPT` puts it (DeepEP's
    # tests import their utils.py from there).
    os.execve(sys.executable, [sys.executable, script] + argv[1:], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
