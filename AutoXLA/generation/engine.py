"""What the generation loop asks of the runtime that executes the model (runtimes/): its device
and lock, its step programs (traced once on the xla runtime, run as they are on the dtensor
runtime), what holds for the length of one call (``generating()``: the dtensor runtime keeps the
weights it gathers), how a tensor's layout is marked, its compile clock and free memory, and
whether steps need fixed shapes (``static_shapes``: buckets and a static cache, or each call's
own shapes and a cache that grows). ``runtimes.xla.XlaGenerationEngine`` and ``runtimes.dtensor.generation.DTensorGenerationEngine``
answer it; the loop's logic (buckets, cache, sampling, stopping) is one, above them."""
from __future__ import annotations

from ..runtimes.xla import XlaRuntime
from ..state import state_of


def engine_of(model):
    """The generation engine of the runtime ``model`` was loaded on (the xla one unless its state
    names another)."""
    runtime = state_of(model).runtime
    return (runtime or XlaRuntime()).generation_engine(model)
