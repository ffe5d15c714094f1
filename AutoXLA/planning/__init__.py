"""The Plan (plan.py: every tensor's place, format and reason, the decoder stack, the KV cache)
and what is forecast from it alone (memory, communication), the HLO parser that checks the
forecasts against compiled programs (hlo.py), TPU topology presets and shipped model configs.
Pure Python over the plan's values (sharding/): no weights, no XLA devices, never torch_xla."""
from .plan import Plan, TensorPlan, build_plan

__all__ = ["Plan", "TensorPlan", "build_plan"]
