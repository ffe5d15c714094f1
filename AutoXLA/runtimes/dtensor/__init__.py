"""The dtensor runtime: the plan executed with torch.distributed's DeviceMesh and DTensor, one
process per device (docs/runtimes.md)."""
from .runtime import DTensorRuntime

__all__ = ["DTensorRuntime"]
