"""Errors of the op library."""


class ShapeError(ValueError):
    """Inputs a kernel cannot take (shape, dtype or device); the message names the value and what is accepted."""
