"""The compile path: the kernel plan a model needs, building missing kernels at start, the `compile` and `kernels` commands."""
