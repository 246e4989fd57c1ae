"""tilekernels: the op library. Each op is declared once with its PyTorch reference (`tilekernels.ops`)."""

from tilekernels.op import OpDecl, OpTable


def reference_table(invariant: bool = False) -> OpTable:
    """The op table whose every entry runs the PyTorch reference (the CPU path); `invariant`: each in the
    batch-invariant form of `tilekernels.invariant` (a token's result does not depend on its batch)."""
    from tilekernels.invariant import reference_impl
    from tilekernels.ops import DECLARED

    return OpTable({name: reference_impl(decl, invariant) for name, decl in DECLARED.items()}, DECLARED)


__all__ = ["OpDecl", "OpTable", "reference_table"]
