"""bench/deepep_one_gpu.py, the launcher that runs DeepEP's own test scripts with all their
ranks on one GPU: its device and backend mappings, and (on CPU) a script written as DeepEP's
tests are (torch.multiprocessing.spawn, an NCCL group over tcp://, set_device(local_rank),
the collectives they call) run through it."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import conftest

_BENCH = os.path.join(conftest.REPO, "bench", "deepep_one_gpu.py")
_spec = importlib.util.spec_from_file_location("deepep_one_gpu", _BENCH)
launcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launcher)

#: Generous ceiling for the script's two spawned ranks (torch imports on a loaded 2-core
#: machine); they finish in seconds when it is idle.
_TIMEOUT = 180


def test_every_cuda_device_is_the_one_gpu():
    assert launcher.one_device(3) == 0 and launcher.one_device(0) == 0
    assert launcher.one_device(-1) == -1 and launcher.one_device(None) is None
    assert launcher.one_device("cuda:5") == "cuda:0" and launcher.one_device("cuda") == "cuda:0"
    assert launcher.one_device(torch.device("cuda", 7)) == torch.device("cuda", 0)
    assert launcher.one_device("cpu") == "cpu"


def test_nccl_is_gloo_and_other_backends_are_kept():
    import torch.distributed as dist
    for b in ("nccl", "NCCL", dist.Backend.NCCL, "cpu:gloo,cuda:nccl", None):
        assert launcher.one_backend(b) == "gloo"
    assert launcher.one_backend("gloo") == "gloo" and launcher.one_backend("mpi") == "mpi"


_SCRIPT = '''
import inspect, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def test_loop(local_rank, num_ranks, out, port):
    params = dict(backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=num_ranks,
                  rank=local_rank)
    if "device_id" in inspect.signature(dist.init_process_group).parameters:
        params["device_id"] = torch.device(f"cuda:{local_rank}")
    dist.init_process_group(**params)
    group = dist.new_group(list(range(num_ranks)))
    t = torch.tensor([local_rank + 1], dtype=torch.int32)
    dist.all_reduce(t, group=group)
    g = torch.empty(num_ranks * 2, dtype=torch.int64)
    dist.all_gather_into_tensor(g, torch.tensor([local_rank, 10 * local_rank]), group=group)
    parts = [torch.empty(2, dtype=torch.bfloat16) for _ in range(num_ranks)]
    dist.all_gather(parts, torch.full((2,), local_rank + 0.5, dtype=torch.bfloat16), group=group)
    h = torch.full((2,), 0.25 * (local_rank + 1), dtype=torch.bfloat16)
    dist.all_reduce(h, group=group)
    b = torch.tensor([local_rank], dtype=torch.float32)
    dist.broadcast(b, src=1, group=group)
    dist.barrier()
    import deep_ep
    with open(os.path.join(out, f"{local_rank}.txt"), "w") as f:
        f.write(repr((t.tolist(), g.tolist(), [p.float().tolist() for p in parts], b.tolist(),
                      deep_ep.__file__, os.environ.get("CUDA_VISIBLE_DEVICES"),
                      h.float().tolist())))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(test_loop, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)
'''


def test_a_deepep_style_script_runs_unmodified_through_the_launcher(tmp_path):
    """The script asks for NCCL (which this CPU torch does not have) and set_device-free CUDA
    ids; through the launcher its ranks join a gloo group, its collectives give what NCCL's
    would, and `import deep_ep` is deepepd's."""
    script = tmp_path / "test_like_deepeps.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH="")
    p = subprocess.run([sys.executable, _BENCH, "--gpu", "0", str(script), str(tmp_path),
                        str(conftest.free_ports()[0])], env=env, capture_output=True, text=True,
                       timeout=_TIMEOUT)
    assert p.returncode == 0, p.stdout + p.stderr
    compat = os.path.join(conftest.REPO, "python", "deep_ep_compat", "__init__.py")
    for r in range(2):
        got = eval((tmp_path / f"{r}.txt").read_text())
        assert got[0] == [3]
        assert got[1] == [0, 0, 1, 10]
        assert got[2] == [[0.5, 0.5], [1.5, 1.5]]
        assert got[3] == [1.0]
        assert os.path.realpath(got[4]) == os.path.realpath(compat)
        assert got[5] == "0"
        assert got[6] == [0.75, 0.75]  # a bfloat16 sum, made in float32 on the host


def test_without_the_launcher_the_script_fails_on_this_machine(tmp_path):
    """What the launcher maps away: the same script, run as it is, cannot make its NCCL group
    here (no NCCL in this torch, or no GPU)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the script may run without the launcher")
    script = tmp_path / "test_like_deepeps.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.path.join(conftest.REPO, "python"))
    p = subprocess.run([sys.executable, str(script), str(tmp_path), str(conftest.free_ports()[0])], env=env,
                       capture_output=True, text=True, timeout=_TIMEOUT)
    assert p.returncode != 0
