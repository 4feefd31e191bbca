"""The rank processes of test_mask.py: a world of MASK_WORLD started by
torch.multiprocessing.spawn (gloo over a FileStore), each rank a
deep_ep.Buffer(group, ..., enable_shrink=True) on the session's daemon, masking MASKED with
DeepEP's low_latency_update_mask_buffer and holding every call to numpy's answer with that
rank's experts removed from every top-k and its tokens none."""
import os
import pickle

import numpy as np
import torch

import ranks

MASK_WORLD = 4
MASKED = 2
MASK_SHAPE = dict(hidden=128, num_experts=8, num_topk=3, num_tokens=8)


def _want_ll(every_idx: np.ndarray, rank: int, masked: set) -> np.ndarray:
    """recv_count of this rank's local experts: the selections of unmasked sources."""
    s = MASK_SHAPE
    L = s["num_experts"] // MASK_WORLD
    counts = np.zeros(L, dtype=np.int64)
    for src in range(MASK_WORLD):
        if src in masked:
            continue
        for row in every_idx[src]:
            for e in set(int(v) for v in row if v >= 0):
                if e // L == rank:
                    counts[e - rank * L] += 1
    return counts


def mask_rank(rank: int, sock: str, store: str, seed: int, outdir: str) -> None:
    """Process `rank`: an unmasked round, then MASKED masked (low-latency and throughput,
    checked here against numpy's masked answer), the query, then cleaned (a full round
    again); pickles what it saw, or the exception, into outdir/<rank>.pkl."""
    import torch.distributed as dist
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "DEEPEP_JOB_ID", "SLURM_PROCID", "SLURM_JOB_ID"):
        os.environ.pop(name, None)
    os.environ["DEEPEPD_SOCKET"] = sock
    W, s = MASK_WORLD, MASK_SHAPE
    n, hidden, E, K = s["num_tokens"], s["hidden"], s["num_experts"], s["num_topk"]
    L = E // W
    dist.init_process_group("gloo", store=dist.FileStore(store, W), rank=rank, world_size=W)
    group = dist.new_group(list(range(W)))
    deep_ep = ranks.import_compat()
    out = {}
    try:
        b = deep_ep.Buffer(group, num_rdma_bytes=1 << 20, low_latency_mode=True,
                           num_qps_per_rank=L, explicitly_destroy=True, enable_shrink=True,
                           hidden=hidden, num_experts=E, num_topk=K, max_tokens_per_rank=n,
                           max_ll_tokens_per_rank=n)
        gen = torch.Generator().manual_seed(seed * 16 + rank)
        x = torch.ones((n, hidden), dtype=torch.bfloat16) * (rank + 1)
        scores = torch.rand((n, E), generator=gen) + 1
        idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1]
        w = torch.rand((n, K), generator=gen)
        every = [torch.empty_like(idx) for _ in range(W)]
        dist.all_gather(every, idx, group=group)
        every_idx = np.stack([t.numpy() for t in every])

        def ll_round(masked: set) -> dict:
            recv, count, handle, ev, hook = b.low_latency_dispatch(x, idx, n, E, use_fp8=False)
            y = recv.clone()
            c, _, _ = b.low_latency_combine(y, idx, w, handle)
            live = torch.tensor([[int(e) // L not in masked and rank not in masked
                                  for e in row] for row in idx])
            return dict(count=count.numpy().copy(),
                        want_count=_want_ll(every_idx, rank, masked) if rank not in masked
                        else np.zeros(L, dtype=np.int64),
                        combined=c.float().numpy().copy(),
                        want_combined=(x.float() * (w * live).sum(1, keepdim=True)).numpy(),
                        dropped=b.dropped(handle),
                        want_dropped=int((~live & (idx >= 0)).sum()))

        def tp_round(masked: set) -> dict:
            recv_x, _, _, counts, handle, _ = b.dispatch(x, topk_idx=idx, topk_weights=w)
            sources = sorted(set(int(v) for v in recv_x[:, 0].float().tolist()))
            c, _, _ = b.combine(recv_x, handle)
            dests = torch.tensor([len(set(int(e) // L for e in row
                                          if int(e) // L not in masked)) if rank not in masked
                                  else 0 for row in idx])
            return dict(sources=sources,
                        want_sources=[q + 1 for q in range(W) if q not in masked
                                      and rank not in masked
                                      and any(int(e) // L == rank for e in every_idx[q].ravel())],
                        combined=c.float().numpy().copy(),
                        want_combined=(x.float() * dests.view(-1, 1)).numpy(),
                        dropped=b.dropped(handle))

        out["before"] = ll_round(set())
        status = torch.full((W,), 7, dtype=torch.int32)
        b.low_latency_query_mask_buffer(status)
        out["status_before"] = status.tolist()
        b.low_latency_update_mask_buffer(MASKED, True)
        b.low_latency_query_mask_buffer(status)
        out["status_masked"] = status.tolist()
        out["mask_epoch"] = b.mask()[1]
        out["masked_ll"] = ll_round({MASKED})
        out["masked_tp"] = tp_round({MASKED})
        b.low_latency_clean_mask_buffer()
        b.low_latency_query_mask_buffer(status)
        out["status_clean"] = status.tolist()
        out["after"] = ll_round(set())
        b.destroy()
    except Exception as e:  # reported by the test, with the rank
        out["error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()
