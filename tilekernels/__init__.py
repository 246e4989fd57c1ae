"""tilekernels: the op library. Each op is declared once with its PyTorch reference (`tilekernels.ops`)."""

from tilekernels.op import OpDecl, OpTable


def reference_table() -> OpTable:
    """The op table whose every entry runs the PyTorch reference (the CPU path)."""
    from tilekernels.ops import DECLARED

    return OpTable({name: decl.reference for name, decl in DECLARED.items()}, DECLARED)


__all__ = ["OpDecl", "OpTable", "reference_table"]
