from .hosts import Host
from .mesh import AXES, MeshShape, mesh_shape_for, normalize_strategy
from .multislice import MultiSlice
from .plan import Plan, TensorPlan, build_plan

__all__ = ["AXES", "Host", "MeshShape", "MultiSlice", "Plan", "TensorPlan", "build_plan",
           "mesh_shape_for", "normalize_strategy"]
