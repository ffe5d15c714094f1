"""Generation with fixed shapes (docs/generation.md): static KV cache, bucketed shapes, sampling
on the device, a persistent compilation cache and ahead-of-time warm-up."""
from ..saving import unwrap
from .buckets import GenerationOptions
from .loop import generate
from .warmup import WarmupReport, warm_up

__all__ = ["GenerationOptions", "WarmupReport", "attach", "generate", "warm_up"]


def attach(model, options=None):
    """Give ``model`` (and the transformers model inside a wrapper) AutoXLA's generate."""
    import functools

    model.autoxla_generation = GenerationOptions.from_any(options)
    bound = functools.partial(generate, model)
    functools.update_wrapper(bound, generate)
    model.generate = bound
    inner = unwrap(model)
    if inner is not model:
        inner.autoxla_generation = model.autoxla_generation
        inner.generate = bound
    return model
