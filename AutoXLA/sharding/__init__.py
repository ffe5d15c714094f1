from .mesh import AXES, MeshShape, mesh_shape_for, normalize_strategy
from .plan import Plan, TensorPlan, build_plan

__all__ = ["AXES", "MeshShape", "Plan", "TensorPlan", "build_plan", "mesh_shape_for",
           "normalize_strategy"]
