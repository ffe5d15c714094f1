"""Forecasts from a Plan alone (memory, communication) and their check against compiled programs;
TPU topology presets and shipped model configs. Pure Python over a Plan (sharding/plan.py): no
weights, no XLA devices, never torch_xla (measure.py compiles in a child process)."""
