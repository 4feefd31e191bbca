"""deep_ep.utils: EventHandle and EventOverlap, as Megatron-LM imports them, and the test
helpers DeepEP 2.x moved into its package, which its tests/legacy/ scripts import:
deep_ep.utils.envs (init_dist, dist_print), deep_ep.utils.math (calc_diff, the per-token FP8
casts, hash_tensor, inplace_unique, create_grouped_scores, ...) and deep_ep.utils.testing
(bench, bench_kineto).  The submodules are imported on use, as DeepEP's are: importing
deep_ep.utils for its events loads no profiler or process-group code."""
from deepep.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
