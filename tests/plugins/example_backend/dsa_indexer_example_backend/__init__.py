"""An example third-party backend: what a vendor ships to add an arch without touching dsa_indexer.

It serves a new arch, ``sm103``, with a top-k built on ``torch.topk`` (a different algorithm from the
reference's stable sort, same contract), registered through the same hook as the built-in backends.
"""

import torch

from dsa_indexer import hookimpl

EXAMPLE_ARCH = "sm103"


def topk_via_torch_topk(logits, k, ends, starts=None, block_table=None, row_request=None):
    """k largest of columns [start, end) per row, in ascending column order; ties to the lower index; -1 padded."""
    rows, cols = logits.shape
    col = torch.arange(cols, device=logits.device)
    start = torch.zeros_like(ends) if starts is None else starts
    visible = (col >= start[:, None]) & (col < ends[:, None])
    masked = torch.where(visible, logits, torch.full_like(logits, float("-inf")))
    take = min(k, cols)
    kth = torch.topk(masked, take, dim=1).values[:, -1:]
    above = visible & (masked > kth)
    tied = visible & (masked == kth)
    # Among keys equal to the k-th value, the lowest columns fill the remaining places.
    room = take - above.sum(dim=1, keepdim=True)
    chosen = above | (tied & (torch.cumsum(tied.int(), dim=1) <= room))
    big = torch.iinfo(torch.int64).max
    picked = torch.sort(torch.where(chosen, col, torch.full_like(col, big)), dim=1).values[:, :take]
    local = torch.where(picked == big, torch.full_like(picked, -1), picked - start[:, None].long())
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    out[:, :take] = local.to(torch.int32)
    if block_table is not None:
        req = torch.arange(rows, device=logits.device) if row_request is None else row_request.long()
        pos = out.clamp_min(0).long()
        slots = block_table.long()[req[:, None], pos // 64] * 64 + pos % 64
        out = torch.where(out >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)
    return out


@hookimpl
def dsa_indexer_register(registry):
    registry.implementation("topk_indices", impl_id="topk_indices.example.torch_topk", targets=(EXAMPLE_ARCH,),
                            priority=150, description="example plugin: torch.topk-based top-k for sm103"
                            )(lambda: topk_via_torch_topk)
