"""Several devices: data, tensor and expert parallelism over torch.distributed, EPLB (docs/parallel.md)."""
