"""Forecasts from a Plan alone (memory, communication) and their check against compiled programs."""
