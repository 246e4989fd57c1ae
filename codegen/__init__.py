"""codegen: the compile driver. (op kernel, variant, target) -> artifact, through a content-addressed
cache with atomic publication; manifests for `deepinfer compile`."""

from codegen.compiler import Artifact, Compiler, Request
from codegen.errors import CompileError, NotBuiltError

__all__ = ["Artifact", "CompileError", "Compiler", "NotBuiltError", "Request"]
