"""Step 5: output and activation sharding, gradient checkpointing, FSDPv2."""
from __future__ import annotations

import functools

import torch
from torch import nn

from .. import backend, saving
from ..sharding import rules
from ..sharding.mesh import AXES, MeshShape
from ..state import record_state
from .scan import StackedDecoderLayers, stack_of


def decoder_layer_classes(model: nn.Module) -> set[type]:
    """The classes transformers marks as not-to-split: the decoder layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _mesh_shape(mesh) -> MeshShape:
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    return MeshShape(*(sizes.get(a, 1) for a in AXES))


def activation_spec(t: torch.Tensor, mesh) -> tuple | None:
    """(batch on data+fsdp, sequence unsplit, hidden/vocab on model) where they divide.

    Not Megatron's layout (the residual stream whole on model), though that measured 1.21x
    (2d, 3d) to 3.13x (mp) fewer collective bytes per training step: with it, XLA:CPU computed
    wrong logits for int4 blocks with zero points on a 2d mesh at 256 tokens (SmolLM2
    perplexity 2290 instead of 34.9; right at 512 tokens and under fsdp and mp). Until that is
    understood the plan keeps this layout; docs/planning.md has the measurements.
    """
    shape = _mesh_shape(mesh)
    if t.dim() < 2:
        return None
    spec = [rules.batch_axes(shape, t.shape[0])] + [None] * (t.dim() - 1)
    if t.dim() == 3 and shape.model > 1 and t.shape[-1] % shape.model == 0:
        spec[-1] = "model"
    return tuple(spec) if any(a is not None for a in spec) else None


def shard_output(output, mesh) -> None:
    """Annotates a model's or a decoder layer's output: a tensor, a tuple, or a ModelOutput."""
    if isinstance(output, torch.Tensor):
        tensors = [output]
    elif isinstance(output, dict):   # transformers' ModelOutput is an OrderedDict
        tensors = [v for k, v in output.items() if k in ("logits", "last_hidden_state")]
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        tensors = [output[0]]
    else:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "xla":
            spec = activation_spec(t, mesh)
            if spec is not None:
                backend.mark_sharding(t, mesh, spec)


def _shard_gradients_like_parameters(model: nn.Module, mesh) -> None:
    """Each gradient takes its parameter's sharding as it is accumulated, on fsdp meshes.

    Nothing else constrains a ``.grad``, and under fsdp XLA returned every gradient whole on every
    device, with or without FSDPv2: tiny Llama on 8 devices, 770.8 KiB of step outputs per
    device against 52.2 KiB of sharded gradients (96.6 annotated), and the step's collectives
    fell from 1155 to 1124 KiB. Not on meshes with a model axis yet: with Megatron's layout
    the annotation added collective-permutes on which XLA:CPU's 8-device runtime deadlocked in a
    2d training step (a rendezvous timeout that aborts the process), and under mp it cost
    collectives (806 -> 904 KiB). So 2d/3d/mp gradients stay as XLA makes them, partly
    replicated (2d: 385.6 KiB of outputs against 52.3 sharded). docs/planning.md, "Gradients".
    """
    if _mesh_shape(mesh).fsdp == 1 or _mesh_shape(mesh).model > 1:
        return
    for p in model.parameters():
        if p.requires_grad and p.device.type == "xla":
            p.register_post_accumulate_grad_hook(lambda q: backend.shard_like(q.grad, q))


def _no_cache_in_training(module, args, kwargs):
    # A KV cache is useless in a checkpointed training step and would be filled twice.
    if module.training:
        kwargs["use_cache"] = False
    return args, kwargs


def _checkpoint_with_torch_xla(model: nn.Module) -> None:
    """transformers' gradient_checkpointing_enable (which Trainer and TRL's SFTTrainer call, TRL
    by default) checkpoints with torch.utils.checkpoint, which fails on an XLA tensor ("module
    'torch' has no attribute 'xla'"). Route it to torch_xla's checkpoint, keeping the caller's
    options except ``use_reentrant``: torch_xla's is re-entrant only (transformers then makes
    the inputs require grad, as it does for peft)."""
    original = getattr(model, "_set_gradient_checkpointing", None)
    if original is None:
        return

    def set_checkpointing(enable: bool = True, gradient_checkpointing_func=None,
                          every_n_layers: int = 1):
        options = dict(getattr(gradient_checkpointing_func, "keywords", None) or {})
        options.pop("use_reentrant", None)
        func = functools.partial(backend.activation_checkpoint, **options)
        return original(enable=enable, gradient_checkpointing_func=func,
                        every_n_layers=every_n_layers)

    model._set_gradient_checkpointing = set_checkpointing


def wrap(model: nn.Module, plan, mesh, opts) -> nn.Module:
    stack = stack_of(model)
    _checkpoint_with_torch_xla(model)
    layer_classes = decoder_layer_classes(model)
    if stack is not None:
        # The scanned loop recomputes each layer in its backward (checkpointing is built in) and
        # shards each layer's output itself; FSDPv2 wraps the stack, whose shells hold no tensors.
        stack.output_hook = functools.partial(shard_output, mesh=mesh)
        layer_classes = {StackedDecoderLayers}
    checkpoint_module = backend.fsdpv2()[2] if opts.gradient_checkpointing else None
    if opts.gradient_checkpointing:
        if not layer_classes:
            raise ValueError(f"gradient_checkpointing=True needs decoder layers, and "
                             f"{type(model).__name__} declares none (_no_split_modules)")
        model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
    record_state(model, plan=plan, mesh=mesh)
    saving.attach(model)
    _shard_gradients_like_parameters(model, mesh)
    if stack is not None:
        # The layers before the loop (plan.start) run unrolled as whole modules: checkpointed
        # and their outputs sharded as an unscanned model's layers, inside the stack's FSDP unit.
        for m in stack.shells[:stack.stack_plan.start]:
            if opts.gradient_checkpointing:
                checkpoint_module(m)
            m.register_forward_hook(lambda _m, _i, out: shard_output(out, mesh))
    if not opts.use_fsdp_wrap:
        if stack is None:      # a scanned stack checkpoints and shards each layer itself
            if opts.gradient_checkpointing:
                for m in model.modules():
                    if type(m) in layer_classes:
                        checkpoint_module(m)
            for m in model.modules():
                if type(m) in layer_classes:
                    m.register_forward_hook(lambda _m, _i, out: shard_output(out, mesh))
        model.register_forward_hook(lambda _m, _i, out: shard_output(out, mesh))
        return model
    FSDPv2, transformer_auto_wrap_policy, _ = backend.fsdpv2()
    policy = opts.auto_wrap_policy
    if policy is None:
        if not layer_classes:
            raise ValueError(f"use_fsdp_wrap=True needs an auto_wrap_policy: {type(model).__name__} "
                             "declares no decoder layer classes (_no_split_modules)")
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes)
    wrapper_cls = None
    if opts.gradient_checkpointing and stack is None:
        def wrapper_cls(m, *args, **kwargs):  # checkpoint first, then shard: the order torch_xla needs
            return FSDPv2(checkpoint_module(m), *args, **kwargs)
    wrapped = FSDPv2(model, mesh=mesh, shard_output=opts.shard_output_callable or shard_output,
                     auto_wrap_policy=policy, auto_wrapper_callable=wrapper_cls)
    record_state(wrapped, plan=plan, mesh=mesh, module=model)
    return saving.attach(wrapped)
