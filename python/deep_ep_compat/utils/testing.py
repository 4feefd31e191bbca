"""deep_ep.utils.testing: the timers DeepEP 2.x's test scripts import from its package.

bench times whole calls (CUDA events on a GPU; the host clock without CUDA, where deepepd's
host backend has finished every call when it returns).  bench_kineto times kernels by name
with torch's profiler, as DeepEP's does: deepepd names its kernels so that DeepEP's names
('dispatch', 'combine') each match one (docs/python.md, "Profiler timing by kernel name");
a name that matches no kernel (DeepEP's 'notify', which deepepd has no kernel of) times 0.
Times are in seconds.

Environment, as DeepEP's: EP_USE_NVIDIA_TOOLS=1 makes bench_kineto return 1 for each name
without profiling (the profiler conflicts with Nsight and Compute Sanitizer);
EP_DISABLE_BARRIER_PROFILING=1 turns barrier_comm_profiling off.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

__all__ = ["bench", "bench_kineto", "flush_l2_cache", "suppress_stdout_stderr"]

#: Bytes written to evict the GPU's L2 cache before a timed call: more than any GPU's L2.
L2_FLUSH_BYTES = 256 * 10 ** 6
#: GPU clock cycles of the spin kernel barrier_comm_profiling queues before each call (about
#: 10 ms), so that every rank's launches are queued before the barrier releases them.
SLEEP_CYCLES = 2 * 10 ** 7


def _env_flag(name: str) -> bool:
    """Whether $name is a non-zero integer (DeepEP reads its switches so); ValueError naming
    the variable when it is not an integer."""
    text = os.environ.get(name, "").strip() or "0"
    try:
        return int(text) != 0
    except ValueError:
        raise ValueError(f"${name}={text!r} is not an integer (0 or 1)") from None


def flush_l2_cache(enabled: bool = True) -> None:
    """Evict the GPU's L2 cache (write L2_FLUSH_BYTES of zeros on the current device), so that
    a timed call does not find its inputs cached by the one before.  Nothing without CUDA."""
    if enabled and torch.cuda.is_available():
        torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


def bench(fn: Callable[[], object], num_warmups: int = 30, num_tests: int = 30,
          post_fn: Optional[Callable[[], object]] = None,
          flush_l2: bool = True) -> Tuple[float, float, float]:
    """(average, least, greatest) seconds of fn(), called num_warmups times untimed, then
    num_tests times timed, post_fn() after each (untimed); the first timed call is dropped,
    as DeepEP's is.  On CUDA each call is timed by events on the current stream, after an L2
    flush (flush_l2); without CUDA by the host clock (flush_l2 has nothing to flush)."""
    if num_tests < 2:
        raise ValueError(f"bench: num_tests={num_tests}; the first timed call is dropped, so "
                         "at least 2 are needed")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    for _ in range(num_warmups):
        fn()
    times: List[float] = []
    if cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
        for start, end in zip(starts, ends):
            flush_l2_cache(flush_l2)
            start.record()
            fn()
            end.record()
            if post_fn is not None:
                post_fn()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    else:
        for _ in range(num_tests):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if post_fn is not None:
                post_fn()
    times = times[1:]
    return sum(times) / len(times), min(times), max(times)


class suppress_stdout_stderr:
    """Send file descriptors 1 and 2 (and sys.stdout, sys.stderr) to /dev/null while open:
    the profiler prints from C++ (kineto's warnings), which redirecting sys.stdout alone would
    not silence."""

    def __enter__(self) -> "suppress_stdout_stderr":
        sys.stdout.flush()
        sys.stderr.flush()
        self._null = open(os.devnull, "w")
        self._saved = [(fd, os.dup(fd)) for fd in (1, 2)]
        for fd, _ in self._saved:
            os.dup2(self._null.fileno(), fd)
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout = sys.stderr = self._null
        return self

    def __exit__(self, *_: object) -> None:
        sys.stdout, sys.stderr = self._streams
        for fd, saved in self._saved:
            os.dup2(saved, fd)
            os.close(saved)
        self._null.close()


class _nothing:
    """A context manager that does nothing (bench_kineto without suppress_kineto_output)."""

    def __enter__(self) -> "_nothing":
        return self

    def __exit__(self, *_: object) -> None:
        pass


def _kernel_events(prof: "torch.profiler.profile") -> list:
    """The GPU kernel events of prof's recorded cycle."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def bench_kineto(fn: Callable[[], object], kernel_names: Union[str, Tuple[str, ...]],
                 num_tests: int = 30, suppress_kineto_output: bool = False,
                 trace_path: Optional[str] = None, flush_l2: bool = True,
                 barrier_comm_profiling: bool = False, num_kernels_per_period: int = 1,
                 barrier: Optional[Callable[[], object]] = None
                 ) -> Union[float, list]:
    """The average seconds of the GPU kernels whose names contain kernel_names (a name, or a
    tuple of names: then a list, one per name), over num_tests calls of fn() recorded after
    num_tests untimed ones, as DeepEP's bench_kineto.  A name that several distinct kernels
    contain is an error (its time would mix them); one no kernel has times 0.

    flush_l2: evict L2 before each call.  barrier_comm_profiling: before each call, a ~10 ms
    spin kernel and then a barrier (barrier(), else an all_reduce of one float on the default
    group), so that every rank's kernels start together and a kernel's time is not its wait
    for a late peer.  num_kernels_per_period=k: each call launches k kernels of the name (a
    hooked low-latency call: its send, then its receive at hook()); that name's result is then
    k averages, of the 1st, ..., k-th launches of the calls.  suppress_kineto_output: silence
    the profiler's prints.  trace_path: also write the Chrome trace there.  Needs CUDA
    (RuntimeError otherwise; the host backend runs no kernels)."""
    if not isinstance(kernel_names, (str, tuple)) or \
            not all(isinstance(n, str) for n in (kernel_names if isinstance(kernel_names, tuple)
                                                 else (kernel_names,))):
        raise TypeError(f"bench_kineto: kernel_names must be a str or a tuple of str, not "
                        f"{kernel_names!r}")
    if num_kernels_per_period < 1:
        raise ValueError(f"bench_kineto: num_kernels_per_period={num_kernels_per_period} "
                         "must be at least 1")
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    if _env_flag("EP_USE_NVIDIA_TOOLS"):
        return [1] * len(names) if isinstance(kernel_names, tuple) else 1
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kineto times GPU kernels and this torch has no CUDA (on the "
                           "host backend time whole calls with bench)")
    # A first call outside the profile, for calls that tune or print on their first run.
    fn()
    torch.cuda.synchronize()
    barrier_comm_profiling = barrier_comm_profiling and \
        not _env_flag("EP_DISABLE_BARRIER_PROFILING")
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                  schedule=schedule)
    with suppress_stdout_stderr() if suppress_kineto_output else _nothing():
        dummy = torch.ones(1, dtype=torch.float, device="cuda")
        with prof:
            for _ in range(2):  # the schedule's warm-up cycle, then the recorded one
                for _ in range(num_tests):
                    flush_l2_cache(flush_l2)
                    if barrier_comm_profiling:
                        torch.cuda._sleep(SLEEP_CYCLES)
                        if barrier is None:
                            dist.all_reduce(dummy)
                        else:
                            barrier()
                    fn()
                torch.cuda.synchronize()
                prof.step()
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    kernels = _kernel_events(prof)
    out: list = []
    for name in names:
        hits = [e for e in kernels if name in e.name]
        distinct = sorted({e.name for e in hits})
        if len(distinct) > 1:
            raise RuntimeError(f"bench_kineto: {len(distinct)} kernels contain {name!r} "
                               f"({', '.join(distinct)}); name one of them")
        if num_kernels_per_period == 1:
            out.append(sum(e.time_range.elapsed_us() for e in hits) / 1e6 / len(hits)
                       if hits else 0)
            continue
        # DeepEP splits by the namespaced name ('::dispatch'), in launch order.
        runs = sorted((e for e in hits if f"::{name}" in e.name), key=lambda e: e.time_range.start)
        k = num_kernels_per_period
        if len(runs) % k:
            raise RuntimeError(f"bench_kineto: {len(runs)} launches of {name!r} are not "
                               f"{k} a call (num_kernels_per_period={k})")
        periods = len(runs) // k
        out.append([sum(e.time_range.elapsed_us() for e in runs[j::k]) / 1e6 / periods
                    if periods else 0 for j in range(k)])
    return out if isinstance(kernel_names, tuple) else out[0]
