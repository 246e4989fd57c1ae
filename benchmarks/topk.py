"""The indexer's top-k at decode: the stable sort the op uses today against `torch.topk` over unique int64 keys (the
score's order-preserving bits, then the entry reversed: ties go to the lower entry, so the picks and their order are
the stable sort's), each in a CUDA graph of 20 calls (a slice step has one CSA layer; the model 21), us per call.
Shapes: V4-Flash's k 512 over the entries of a 4K and a 64K context (1,024 and 16,384 at rate 4), 1-128 rows.
Run on the GPU host: `python benchmarks/topk.py`."""
import torch

from benchmarks.cache_writes import timed
from tilekernels.ops import indexer_topk


def keyed(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """`indexer_topk.reference`'s picks through int64 keys and torch.topk."""
    e = scores.shape[-1]
    entry = torch.arange(e, device=scores.device)
    masked = scores.masked_fill(entry >= visible.view(-1, 1), float("-inf")) + 0.0  # -0.0 -> +0.0
    bits = masked.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # signed order = the floats' order
    top = torch.topk(ordered * (1 << 32) + (e - 1 - entry), min(k, e), dim=-1).values
    picks = (e - 1) - (top & 0xFFFFFFFF)
    return torch.where(picks >= visible.view(-1, 1), -1, picks)


if __name__ == "__main__":
    dev = torch.device("cuda")
    for entries in (1024, 16384):
        for rows in (1, 8, 32, 128):
            scores = torch.randn(rows, entries, device=dev).round(decimals=1)  # ties
            visible = torch.randint(entries // 2, entries + 1, (rows,), device=dev)
            same = torch.equal(keyed(scores, visible, 512), indexer_topk.reference(scores, visible, 512))
            sort = timed(lambda: indexer_topk.reference(scores, visible, 512), 20)
            key = timed(lambda: keyed(scores, visible, 512), 20)
            print(f"| {entries} | {rows} | {sort:.1f} | {key:.1f} | {sort / key:.2f}x | {same} |", flush=True)
