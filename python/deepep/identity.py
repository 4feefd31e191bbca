"""A rank's place in its job, from explicit arguments or the launcher's environment.

deepepd needs no process group: every rank of a job names the same job id
and its own ranks, and the daemon's rendezvous does the rest.  Launchers
already say all of it in the environment:

- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and
  TORCHELASTIC_RUN_ID (one value per job start; a restart gets another
  unless --rdzv-id fixes it);
- SLURM (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
  SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE, and SLURM_JOB_ID with
  SLURM_STEP_ID;
- DEEPEP_JOB_ID, when set, overrides the job id of either.

Where the caller gives a torch.distributed process group (DeepEP's
``Buffer(group, ...)``), the identity is the group's instead (from_group):
its rank and size, its members that share this rank's node (its daemon) as the
local ranks, and a job
id agreed over the group, so that an expert-parallel group inside a larger
world, several such groups, and one process in several groups each make a
job of their own.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

from . import _lib

JOB_ID_ENV = "DEEPEP_JOB_ID"
_JOB_ID_RE = re.compile(r"[A-Za-z0-9._:-]+")  # fullmatch: "$" would let a final "\n" by


@dataclass(frozen=True)
class Identity:
    """Who this rank is: the fields of dep_attach_args that are not the shape."""
    job_id: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    #: The node of each rank (nodes numbered in the order of their lowest rank), where it is
    #: known: from a group, whose members said their hosts.  None from the environment, whose
    #: launchers (torchrun, SLURM's default block distribution) number ranks node by node:
    #: rank r is then on node r // local_world_size (node_of).  Not sent to the daemon.
    nodes: Optional[Tuple[int, ...]] = field(default=None, compare=False)

    def node_of(self) -> Optional[Tuple[int, ...]]:
        """The node of each rank: `nodes` where known, else node by node (rank //
        local_world_size) where local_world_size divides world_size; None where neither says
        (an uneven world from the environment)."""
        if self.nodes is not None:
            return self.nodes
        if self.world_size % self.local_world_size:
            return None
        return tuple(r // self.local_world_size for r in range(self.world_size))

    def check(self) -> None:
        """ValueError naming the first field out of range (TypeError for a field that is not
        an int)."""
        if not isinstance(self.job_id, str) or not _JOB_ID_RE.fullmatch(self.job_id):
            raise ValueError(f"job_id {self.job_id!r}: use 1..{_lib.JOB_ID_MAX - 1} characters "
                             "of [A-Za-z0-9._:-]")
        if len(self.job_id.encode()) >= _lib.JOB_ID_MAX:
            raise ValueError(f"job_id {self.job_id!r} is longer than {_lib.JOB_ID_MAX - 1} bytes")
        # The library's bounds (deepep.h DEP_MAX_WORLD, DEP_MAX_LOCAL_RANKS), narrower than
        # the dep_attach_args fields these cross into.
        for name, lo, hi in (("rank", 0, _lib.MAX_WORLD - 1), ("world_size", 1, _lib.MAX_WORLD),
                             ("local_rank", 0, _lib.MAX_LOCAL_RANKS - 1),
                             ("local_world_size", 1, _lib.MAX_LOCAL_RANKS)):
            _lib.checked_int(name, getattr(self, name), _lib.field_type(_lib.AttachArgs, name),
                             lo, hi)
        if self.local_world_size > self.world_size:
            raise ValueError(f"local_world_size {self.local_world_size} exceeds world_size "
                             f"{self.world_size}")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.local_rank >= self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} is not below local_world_size "
                             f"{self.local_world_size}")


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    v = env.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"${name}={v!r} is not an integer") from None


def _slurm_tasks_per_node(env: Mapping[str, str]) -> Optional[int]:
    """This node's task count: SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE's entry for
    the node (its list "4(x2),3" gives counts per node in node order, SLURM_NODEID indexes it)."""
    n = _int(env, "SLURM_NTASKS_PER_NODE")
    if n is not None:
        return n
    spec = env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"$SLURM_TASKS_PER_NODE={spec!r} is not of the form 4(x2),3")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(env, "SLURM_NODEID") or 0
    if node >= len(counts):
        raise ValueError(f"$SLURM_NODEID={node} is past $SLURM_TASKS_PER_NODE={spec!r}")
    return counts[node]


def from_environment(env: Optional[Mapping[str, str]] = None, **given: Optional[object]) -> Identity:
    """The Identity from the explicit fields in `given` (None: not given), the rest from the
    launcher's environment (torchrun first, then SLURM).  ValueError names what is missing."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        found = {
            "rank": _int(env, "RANK"),
            "world_size": _int(env, "WORLD_SIZE"),
            "local_rank": _int(env, "LOCAL_RANK"),
            "local_world_size": _int(env, "LOCAL_WORLD_SIZE"),
            "job_id": env.get("TORCHELASTIC_RUN_ID") or None,
        }
    elif "SLURM_PROCID" in env:
        launcher = "SLURM"
        job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
        found = {
            "rank": _int(env, "SLURM_PROCID"),
            "world_size": _int(env, "SLURM_NTASKS"),
            "local_rank": _int(env, "SLURM_LOCALID"),
            "local_world_size": _slurm_tasks_per_node(env),
            "job_id": f"slurm-{job}.{step}" if job and step else (f"slurm-{job}" if job else None),
        }
    else:
        launcher = "no launcher"
        found = {}
    if env.get(JOB_ID_ENV):
        found["job_id"] = env[JOB_ID_ENV]
    fields = {}
    for name in ("job_id", "rank", "world_size", "local_rank", "local_world_size"):
        v = given.get(name)
        if v is None:
            v = found.get(name)
        fields[name] = v
    # One node: the local ranks are the world's.
    if fields["local_world_size"] is None and fields["world_size"] is not None and \
            fields["local_rank"] is None and fields["rank"] is not None and launcher == "no launcher":
        fields["local_world_size"], fields["local_rank"] = fields["world_size"], fields["rank"]
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(
            f"{', '.join(missing)}: not given and not found in the environment ({launcher}); pass "
            "them to Buffer(...), or start under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, "
            "LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID) or srun, or set $DEEPEP_JOB_ID for the job id")
    ident = Identity(**fields)  # type: ignore[arg-type]
    ident.check()
    return ident


#: The random part of a job id agreed over a group (hex characters; 64 bits).
_GROUP_ID_HEX = 16
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _launcher_run_id(env: Mapping[str, str]) -> Optional[str]:
    """The launcher's id of this run ($DEEPEP_JOB_ID, torchrun's TORCHELASTIC_RUN_ID, SLURM's
    job and step), where there is one."""
    if env.get(JOB_ID_ENV):
        return env[JOB_ID_ENV]
    if env.get("TORCHELASTIC_RUN_ID"):
        return env["TORCHELASTIC_RUN_ID"]
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    if job:
        return f"slurm-{job}.{step}" if step else f"slurm-{job}"
    return None


def _node_key(daemon_socket: str) -> str:
    """What tells this rank's node from every other: a node is a daemon, so the host (its
    name and this boot's id: two containers may share a host name, and a host's boot id is
    the same in each of its containers, whose ranks share one deepepd) and the daemon's
    socket on it, by its file's identity (device and inode, the same through every bind
    mount of it), or by its path where it cannot be read.  Several daemons on one machine
    (tests of several nodes on one host) are several nodes."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(daemon_socket)
        sock = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        sock = os.path.abspath(daemon_socket)
    return f"{socket.gethostname()}/{boot}/{sock}"


def from_group(group: Any, env: Optional[Mapping[str, str]] = None,
               daemon_socket: Optional[str] = None, **given: Optional[object]) -> Identity:
    """The Identity of this process in a torch.distributed process group, agreed with the
    group's other members in one collective (all_gather_object) at construction, which every
    member must make; nothing else is ever sent over the group.

    rank and world_size are the group's (dist.get_rank(group), dist.get_world_size(group));
    the local ranks are the group's members on this node, in group rank order: on this host
    and attaching to the same daemon (`daemon_socket`, else $DEEPEPD_SOCKET's, else the
    default one; Buffer passes the one it connects to); the job id is
    given's job_id where the caller gives one (every member must then give the same), else
    rank 0's random id, after the launcher's run id where there is one (`env`, as
    from_environment reads it).  The launcher's RANK and WORLD_SIZE, which are the world's,
    are not read.  An explicit field of `given` that disagrees with the group is a
    ValueError naming both, raised before the collective where the group alone decides it
    (rank, world_size), so every member raises alike."""
    import torch.distributed as dist
    env = os.environ if env is None else env
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group given but torch.distributed is not initialized; call "
                         "dist.init_process_group first, or pass group=None and the identity "
                         "(job_id, rank, world_size) or a launcher's environment")
    try:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, TypeError, AttributeError) as e:
        raise TypeError(f"group must be a torch.distributed ProcessGroup this process belongs "
                        f"to, not {type(group).__name__} ({e})") from None
    if rank < 0:
        raise ValueError("this process is not a member of the group it passed")
    for name, have in (("rank", rank), ("world_size", size)):
        v = given.get(name)
        if v is not None and v != have:
            raise ValueError(f"{name} {v!r} was given but the group says {have}; pass one or "
                             "the other (the group's rank and size are the job's)")
    if daemon_socket is None:
        daemon_socket = env.get(_lib.SOCKET_ENV) or _lib.DEFAULT_SOCKET
    every: list = [None] * size
    dist.all_gather_object(every, (_node_key(daemon_socket),
                                   secrets.token_hex(_GROUP_ID_HEX // 2)), group=group)
    here = [r for r, (host, _) in enumerate(every) if host == every[rank][0]]
    local_rank, local_world_size = here.index(rank), len(here)
    for name, have in (("local_rank", local_rank), ("local_world_size", local_world_size)):
        v = given.get(name)
        if v is not None and v != have:
            raise ValueError(f"{name} {v!r} was given but the group has {have} on this node "
                             "(this host and daemon); pass one or the other")
    job_id = given.get("job_id")
    if job_id is None:
        agreed = every[0][1]
        base = _launcher_run_id(env)
        if base:
            # The launcher's id first (deepepctl shows which run a job is), cut to leave
            # room for the agreed part, which alone keeps the jobs of one run apart.
            base = base[:_lib.JOB_ID_MAX - 1 - len(agreed) - 1]
        job_id = f"{base}-{agreed}" if base else f"ep-{agreed}"
    first: dict = {}
    nodes = tuple(first.setdefault(host, len(first)) for host, _ in every)
    ident = Identity(job_id=job_id, rank=rank, world_size=size,  # type: ignore[arg-type]
                     local_rank=local_rank, local_world_size=local_world_size, nodes=nodes)
    ident.check()
    return ident
