"""Rank processes of the identity tests (test_group.py): what from_group makes of a group, with
no daemon asked (the job ids it agrees, the nodes its members are on)."""
from typing import List


def job_id_rank(rank: int, sock: str, store: str, outdir: str) -> None:
    """One process, a gloo world of 1 over a FileStore: the job ids from_group agrees with a
    launcher's long run id in the environment, with none, and with job_id given; pickled into
    outdir/ids.pkl."""
    import os
    import pickle
    import torch.distributed as dist
    from deepep.identity import from_group
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    for name in ("DEEPEP_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(name, None)
    out = {"none": [from_group(None).job_id, from_group(None).job_id],
           "given": from_group(None, job_id="mine").job_id}
    os.environ["TORCHELASTIC_RUN_ID"] = "r" * 70
    out["torchrun"] = from_group(None).job_id
    os.environ["DEEPEP_JOB_ID"] = "fixed"
    out["deepep"] = from_group(None).job_id
    with open(os.path.join(outdir, "ids.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


def node_key_rank(rank: int, socks: List[str], store: str, outdir: str) -> None:
    """Process `rank` of a gloo world of len(socks) over a FileStore: from_group's identity
    when this process names socks[rank] as its daemon's socket, as $DEEPEPD_SOCKET and as
    the argument Buffer passes; pickled into outdir/<rank>.pkl as (by env, by argument)."""
    import os
    import pickle
    import torch.distributed as dist
    from deepep.identity import from_group
    dist.init_process_group("gloo", store=dist.FileStore(store, len(socks)), rank=rank,
                            world_size=len(socks))
    os.environ["DEEPEPD_SOCKET"] = socks[rank]
    by_env = from_group(None)
    os.environ["DEEPEPD_SOCKET"] = "/nonexistent/deepepd.sock"
    by_arg = from_group(None, daemon_socket=socks[rank])
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump((by_env, by_arg), f)
    dist.destroy_process_group()
