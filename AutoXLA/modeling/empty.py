"""Building a model without its weights: parameters on the meta device, buffers real.

Parameters are what the checkpoint supplies, so they need no memory now. Buffers stay on the CPU:
non-persistent ones (rotary ``inv_freq``) are computed in ``__init__`` and not saved, so this is the
only chance to get their values.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..loading.checkpoint import CheckpointError
from ..saving import CONFIG, interrupted_save

# Sizes a config sets that every tensor shape is made of. transformers does not check them: a zero
# divides by zero, a negative one fails deep inside torch, a bool or float slips through as a size.
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
               "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
# Larger than any released model's dimension by orders of magnitude (and what int32 indexing,
# which XLA uses for gathers, can address): a larger size is a typo or a hostile config.
_MAX_SIZE = 2**31 - 1


def load_config(path, **kwargs):
    """``AutoConfig.from_pretrained``, with a config.json that cannot describe a model reported as
    one ValueError naming it (transformers divides by zero heads, raises its own validation error
    for a float size, or KeyError/AttributeError for a field of the wrong type)."""
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError   # transformers' field checks
    except ImportError:          # pragma: no cover - older huggingface_hub
        StrictDataclassError = TypeError

    if not os.path.exists(os.path.join(path, CONFIG)) and interrupted_save(path):
        raise CheckpointError(f"{path} has no {CONFIG}: a save_pretrained into it was interrupted "
                              "(killed or failed while rolling back). Call save_pretrained into it "
                              "again: it restores or finishes the interrupted save first")
    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except (ArithmeticError, TypeError, KeyError, AttributeError, RecursionError,
            StrictDataclassError) as e:
        raise ValueError(f"the config of {path} cannot describe a model ({type(e).__name__}: "
                         f"{' '.join(str(e).split())}); fix its config.json") from e


def check_sizes(config) -> None:
    """Refuse a config (or any of its sub-configs: text, vision...) whose sizes cannot make a
    model, naming the field, its value and the config, before anything is built."""
    name = getattr(config, "_name_or_path", "") or type(config).__name__
    for where, c in _configs(config):
        for field in SIZE_FIELDS:
            value = getattr(c, field, None)
            if value is None:
                continue
            # Vision backbones give one size per stage (Swin, SegFormer: [1, 2, 3, 6]).
            for v in value if isinstance(value, (list, tuple)) and value else [value]:
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _MAX_SIZE:
                    raise ValueError(f"config of {name}: {where}{field}={value!r} is not a size; "
                                     f"it must be a whole number from 1 to {_MAX_SIZE} (or a list "
                                     "of them, one per stage): fix config.json")
        heads, kv = getattr(c, "num_attention_heads", None), getattr(c, "num_key_value_heads", None)
        hidden = getattr(c, "hidden_size", None)
        if not all(isinstance(x, (int, type(None))) for x in (heads, kv, hidden)):
            continue             # per-stage lists: transformers checks those itself
        if heads and kv and heads % kv:
            raise ValueError(f"config of {name}: {where}num_attention_heads={heads} is not a "
                             f"multiple of {where}num_key_value_heads={kv} (each key/value head "
                             "serves a whole group of query heads): fix config.json")
        if heads and hidden and getattr(c, "head_dim", None) is None and hidden % heads:
            raise ValueError(f"config of {name}: {where}hidden_size={hidden} is not a multiple of "
                             f"{where}num_attention_heads={heads} and no head_dim is given: fix "
                             "config.json")


def _configs(config, prefix: str = "", depth: int = 0):
    yield prefix, config
    if depth > 4:        # sub-configs nest one or two levels in practice
        return
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            yield from _configs(sub, f"{prefix}{key}.", depth + 1)


# A tensor this large made while the model is built is a parameter-to-be, never one of the few
# buffers computed in __init__ (rotary frequencies, position ids: kilobytes): it is made on meta
# directly, so an enormous config costs no host memory even for a moment.
_META_ABOVE = 2**26    # elements


class _LargeFactoriesOnMeta(TorchFunctionMode):
    _FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.randn, torch.rand}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FACTORIES and kwargs.get("device") is None:
            # The size: positional ints (empty(2, 3)), one sequence (empty((2, 3)), full's
            # first argument), or the size= keyword.
            if not args:
                size = kwargs.get("size", ())
            elif func is torch.full or isinstance(args[0], (tuple, list, torch.Size)):
                size = args[0]
            else:
                size = args
            try:
                numel = 1
                for n in size:
                    numel *= int(n)
            except (TypeError, ValueError):
                numel = 0
            if numel > _META_ABOVE:
                kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def parameters_on_meta():
    with _LargeFactoriesOnMeta(), _parameters_moved_to_meta():
        yield


@contextlib.contextmanager
def _parameters_moved_to_meta():
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = getattr(param, "__dict__", {})
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original
