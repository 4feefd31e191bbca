"""What test_buffer.py and test_buffer_calls.py share: one rank's Buffer of a small shape and
its tokens (conftest.py's `buf` fixture makes one)."""
import uuid

import torch

import conftest
import deepep

DEV = torch.device(conftest.DEVICE)

SHAPE = dict(hidden=128, num_experts=4, num_topk=2, max_tokens_per_rank=8,
             max_ll_tokens_per_rank=8)


def one_rank(sock, **kw):
    args = dict(job_id="t-" + uuid.uuid4().hex[:10], rank=0, world_size=1, socket=sock)
    args.update(kw)
    return deepep.Buffer(**args)


def tokens(n=4, hidden=128):
    x = torch.ones(n, hidden, dtype=torch.bfloat16, device=DEV)
    idx = torch.tensor([[t % 4, (t + 1) % 4] for t in range(n)], dtype=torch.int64, device=DEV)
    return x, idx, torch.full((n, 2), 0.5, device=DEV)
