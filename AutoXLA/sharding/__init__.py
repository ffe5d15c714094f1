from .hosts import Host
from .mesh import AXES, MeshShape, mesh_shape_for, normalize_strategy
from .multislice import MultiSlice

__all__ = ["AXES", "Host", "MeshShape", "MultiSlice", "mesh_shape_for", "normalize_strategy"]
