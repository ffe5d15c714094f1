"""LoRA on AutoXLA's quantized linears (QLoRA), through peft's own extension point.

peft wraps ``nn.Linear`` and the quantized layers of the libraries it knows; for any other module
it asks the ``LoraConfig`` for a custom LoRA layer (``LoraConfig._register_custom_module``, the
only mapping peft consults before its own dispatchers). ``qlora(config)`` registers
``QuantizedLoraLinear`` for AutoXLA's ``QuantizedLinear``, so that

    model = get_peft_model(model, qlora(LoraConfig(r=8, target_modules=[...])))

trains float adapters A and B beside an int8 or int4 base that stays as it is: the base's
quantized weight is a buffer, never a parameter, so it gets no gradient and no optimizer state.
Merging into the base is refused: its int8 / int4 codes cannot take a float update in place
(merge into a float copy of the model instead).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re

import torch
from torch import nn

from ..generation.engine import engine_of
from ..modeling.scan import StackedDecoderLayers
from ..planning.adapters import AdapterPlan, plan_adapters
from ..quantization.linear import QuantizedLinear
from ..saving import save_pretrained
from ..sharding import rules
from ..state import record_state, state_of

# LoraConfig options that change what the layer computes beyond A and B; none is built here.
_UNSUPPORTED = ("use_dora", "use_qalora", "velora_config", "monteclora_config", "arrow_config",
                "kasa_config")


def qlora(config):
    """``config`` (a peft ``LoraConfig``), able to wrap AutoXLA's quantized linears (returned for
    chaining)."""
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise TypeError(f"qlora() takes a peft LoraConfig, got {type(config).__name__}")
    config._register_custom_module({QuantizedLinear: quantized_lora_linear()})
    return config


def shard_adapters(model) -> AdapterPlan | None:
    """Places a peft model's LoRA adapters the way the plan says (planning/adapters.py: A split
    like its base layer's input dim, B like its output dim) and records them in the model's plan
    (``autoxla_plan.adapters``, its JSON too); returns that AdapterPlan (None when no adapter
    sits in a decoder layer or on the lm_head: any elsewhere stays whole). Call it after
    ``get_peft_model`` and before the optimizer is made (``finetune`` does). On a scanned
    decoder stack (the default load) it also stacks each layer's adapters with the layer
    (``[layers, r, in]``, ``[layers, out, r]``), which the loop needs: until then the model
    refuses to run, naming this call. Unscanned, without it the
    adapters stay whole on every device, which trains the same but costs their bytes, gradients
    and optimizer states on every device. On the dtensor runtime the adapters become DTensors
    placed the same way (from process 0's values), which several processes need: until then
    the model refuses to run there, naming this call."""
    return _place_adapters(model)


def _place_adapters(model, set_values=None) -> AdapterPlan | None:
    """shard_adapters, calling ``set_values(model)`` once the adapters are per-layer tensors
    of their whole shape and before they are stacked or distributed (load_adapter's values)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    state = state_of(base)
    if state.plan is None:
        raise ValueError(f"{type(base).__name__} was not loaded by AutoXLA (no autoxla_plan): "
                         "load it with AutoXLAModelForCausalLM.from_pretrained first")
    wrapped = _lora_layers(model)
    if not wrapped:
        raise ValueError("no LoRA layers found: wrap the model with peft's get_peft_model first")
    # the plan places the decoder layers' adapters and the head's; one elsewhere stays whole
    wrapped = {path: m for path, m in wrapped.items()
               if _IN_LAYER.search(path) or _is_head(state.plan, path)}
    if not wrapped:
        if set_values is not None:
            set_values(model)
        return None
    ranks = {m.r[name] for m in wrapped.values() for name in m.lora_A}
    dtypes = {str(m.lora_A[name].weight.dtype).removeprefix("torch.")
              for m in wrapped.values() for name in m.lora_A}
    plan = plan_adapters(state.plan, max(ranks), dtypes.pop() if len(dtypes) == 1 else "float32",
                         tuple(sorted({path.rsplit(".", 1)[-1] for path in wrapped})))
    if state.runtime is not None:
        _whole_shapes(model, wrapped)
    if set_values is not None:
        set_values(model)
    if state.runtime is None:       # the xla runtime (another runtime is recorded by name)
        _stack_scanned(base, plan, state.mesh)
        engine = engine_of(base)
        for path, layer in wrapped.items():
            for which in ("lora_A", "lora_B"):
                spec = plan.spec_of(path, which)
                for linear in getattr(layer, which).values():
                    if "weight" in linear._parameters:      # not one of a stacked layer's rows
                        engine.mark_sharding(linear.weight, state.mesh, spec)
    else:
        state.runtime.place_adapters(base, wrapped, plan.spec_of)
    if len(ranks) == 1:      # rank_pattern's mixed ranks: placed, but not one plan's bytes
        record_state(base, plan=dataclasses.replace(state.plan, adapters=plan))
    return plan


_IN_LAYER = re.compile(r"\.layers\.\d+\.")
_ADAPTER = re.compile(r"(.+)\.(lora_[AB])\.[^.]+\.weight")


def _is_head(plan, path: str) -> bool:
    return f"{path}.weight" in plan and plan[f"{path}.weight"].role == rules.LM_HEAD


def _stack_scanned(base, plan: AdapterPlan, mesh) -> None:
    """A scanned decoder stack's adapters join it: ``[layers, r, in]`` and ``[layers, out, r]``,
    each placed like the first layer's planned adapter with the layer axis unsplit, so that the
    loop's one traced layer takes each layer's own (modeling/scan.py)."""
    for path, stack in base.named_modules():
        if not isinstance(stack, StackedDecoderLayers):
            continue
        first = f"{path}.{stack.stack_plan.start}"

        def spec_of(name: str) -> tuple:
            found = _ADAPTER.fullmatch(name)
            if found is None:
                raise ValueError(f"{first}.{name} was added to a scanned decoder layer after "
                                 "loading and is not a LoRA adapter: only peft's LoRA adapters "
                                 "can join the stack; load with scan_layers=False")
            return plan.spec_of(f"{first}.{found.group(1)}", found.group(2))

        stack.stack_new_tensors(spec_of, mesh)


def _whole_shapes(model, wrapped: dict) -> None:
    """peft sizes the adapters of a linear whose weight is a DTensor on a mesh with axes besides
    "fsdp" by the weight's local piece (its reading of tensor parallelism, where a module
    computes with its shard); on the dtensor runtime a linear computes with the whole weight, or
    with its block of a tensor-parallel block, which the adapters' placements give them. Such
    adapters are made again at the base layer's whole shape and initialised as peft initialises
    them (``init_lora_weights``); their values until now were peft's initial ones."""
    for path, layer in wrapped.items():
        base = layer.get_base_layer()
        layer.in_features, layer.out_features = base.in_features, base.out_features
        for name in list(layer.lora_A):
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
            if a.shape[1] == base.in_features and b.shape[0] == base.out_features:
                continue
            bias = layer.lora_B[name].bias is not None
            layer.lora_A[name] = nn.Linear(base.in_features, a.shape[0], bias=False,
                                           dtype=a.dtype, device=a.device)
            layer.lora_B[name] = nn.Linear(b.shape[1], base.out_features, bias=bias,
                                           dtype=b.dtype, device=b.device)
            layer.reset_lora_parameters(name, model.peft_config[name].init_lora_weights)
            layer.lora_A[name].requires_grad_(a.requires_grad)
            layer.lora_B[name].requires_grad_(b.requires_grad)


def _lora_layers(model) -> dict:
    """peft's LoRA layers by the path of the projection they wrap in the unwrapped model."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {name.removeprefix(prefix): m for name, m in model.named_modules()
            if isinstance(m, LoraLayer)}


def save_adapter(model, directory) -> None:
    """A peft model's adapter in peft's format (adapter_config.json, adapter_model.safetensors),
    which plain transformers + peft load anywhere. Its tensors are copied to the host first:
    safetensors cannot read an XLA device's; only the adapters are copied, not the base. On the
    dtensor runtime every process calls it and process 0 writes."""
    adapters = {name: t for name, t in model.state_dict().items() if "lora_" in name}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    runtime = state_of(base).runtime
    if runtime is None:             # the xla runtime
        model.save_pretrained(directory, state_dict={n: t.detach().cpu()
                                                     for n, t in adapters.items()})
        return
    # DTensors: every process gathers them whole, one writes (call it on every process)
    runtime.write_whole(adapters, [list(adapters)],
                        lambda copies: model.save_pretrained(directory, state_dict=next(copies)))


def load_adapter(model, directory, is_trainable: bool = False):
    """An adapter saved in peft's format (``save_adapter``, ``autoxla finetune``'s OUT/adapter,
    or any peft LoRA adapter for this architecture) on a model AutoXLA loaded: wrapped as peft
    wraps it (the saved LoraConfig), placed as the plan says (``shard_adapters``) and set to the
    saved values; returns the peft model. ``PeftModel.from_pretrained`` cannot do this on the
    dtensor runtime with several processes: peft sizes adapters there by the weight's local
    piece, and loads whole tensors into them. Call it on every process; frozen unless
    ``is_trainable``."""
    from peft import PeftConfig, get_peft_model
    from peft.utils import load_peft_weights

    config = PeftConfig.from_pretrained(str(directory))
    config.inference_mode = not is_trainable
    peft_model = get_peft_model(model, qlora(config))
    saved = load_peft_weights(str(directory), device="cpu")
    where = os.path.join(str(directory), "adapter_model.safetensors")
    _place_adapters(peft_model, lambda m: _set_adapters(m, saved, where))
    return peft_model


def _set_adapters(model, saved: dict, where: str) -> None:
    """Every adapter parameter set from ``saved`` (peft's file keys: the adapter's name left
    out); a missing or misshapen tensor named with the file."""
    name = model.active_adapter
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "lora_" not in param_name:
                continue
            key = param_name.replace(f".{name}.", ".")
            if key not in saved:
                raise ValueError(f"{where} has no tensor {key} for {param_name}: the adapter "
                                 "was saved for another model or other target modules")
            value = saved[key]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{where}: {key} is {list(value.shape)}, the model's "
                                 f"{param_name} is {list(p.shape)}: the adapter was saved for "
                                 "a model of another size or rank")
            p.copy_(value.to(p.dtype).to(p.device))


def merge_and_save(model, directory) -> nn.Module:
    """A peft model's adapters merged into its float base (W + B A scaling, on the devices, as
    peft merges), written by AutoXLA's save_pretrained as a full checkpoint that transformers and
    from_pretrained load; returns the merged model (peft's wrappers gone). A quantized base is
    refused: merge the saved adapter into the float checkpoint on the host instead
    (training/merge.py's ``merge_checkpoint``, ``autoxla merge``), quantized again if wanted."""
    quantized = [name for name, m in model.named_modules()
                 if isinstance(getattr(m, "base_layer", None), QuantizedLinear)]
    if quantized:
        raise ValueError(
            f"{quantized[0]} (and {len(quantized) - 1} more) wraps a quantized base, which "
            "cannot take the float update: save the adapter (save_adapter(model, ADAPTER_DIR)) "
            "and merge it into the float checkpoint on the host, quantized again if wanted: "
            "merge_checkpoint(FLOAT_DIR, ADAPTER_DIR, OUT, quantization_config) or `autoxla "
            "merge FLOAT_DIR ADAPTER_DIR OUT --bits N`")
    stacks = [m for m in model.modules() if isinstance(m, StackedDecoderLayers)]
    for stack in stacks:
        _merge_stacked(stack)
    merged = model.merge_and_unload()
    for stack in stacks:
        stack.release_unread()          # the stacked adapters, read by no layer any more
    save_pretrained(merged, directory)
    return merged


def _merge_stacked(stack: StackedDecoderLayers) -> None:
    """peft merges ``W += B A scaling`` layer by layer through each layer's weight; a scanned
    stack's layers are rows of one tensor, merged here for every layer at once (a batched
    matmul) and marked merged, so that peft's merge_and_unload only unwraps them."""
    from peft.tuners.lora import LoraLayer

    start = stack.stack_plan.start
    tensors = stack.stacked_tensors()
    for path, layer in stack.shells[start].named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for name in layer.active_adapters:
            if name not in layer.lora_A or name in layer.merged_adapters:
                continue
            a = tensors[f"{path}.lora_A.{name}.weight"]           # [layers, r, in]
            b = tensors[f"{path}.lora_B.{name}.weight"]           # [layers, out, r]
            w = tensors[f"{path}.base_layer.weight"]
            delta = torch.matmul(b, a) * layer.scaling[name]
            if getattr(layer, "fan_in_fan_out", False):           # GPT-2's Conv1D: [in, out]
                delta = delta.transpose(-1, -2)
            with torch.no_grad():
                w.add_(delta.to(w.dtype))
            for i in stack.scanned_layers:
                stack.shells[i].get_submodule(path).merged_adapters.append(name)


@functools.cache
def quantized_lora_linear() -> type:
    """``QuantizedLoraLinear``, the class: made on first use, when peft is imported. peft imports
    accelerate, which imports torch_xla wherever it is installed, and the CLI, which every verb
    loads, must not import torch_xla for `autoxla plan` and `autoxla quantize`."""
    from peft.tuners.lora import LoraLayer

    class QuantizedLoraLinear(nn.Module, LoraLayer):
        """peft's LoRA layer around a ``QuantizedLinear``: ``base(x) + B(A(dropout(x))) * scaling``
        with A and B in float (float32 unless the config says otherwise), the base frozen."""

        def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig,
                     r: int = 0, lora_alpha: int = 1, **kwargs):
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            asked = [name for name in _UNSUPPORTED if getattr(config, name, None)]
            if asked:
                raise ValueError(f"LoRA on AutoXLA's quantized linear ({self.get_base_layer()!r}) "
                                 f"does not support {', '.join(asked)}: plain LoRA only; set "
                                 f"{asked[0]} off")
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if kwargs.get("adapter_names") is not None:
                raise ValueError("adapter_names (a batch mixing adapters) is not supported on "
                                 "AutoXLA's quantized linears; activate one adapter set instead")
            result = self.base_layer(x)
            if self.disable_adapters:
                return result
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                a, b = self.lora_A[name], self.lora_B[name]
                h = self.lora_dropout[name](self._cast_input_dtype(x, a.weight.dtype))
                result = result + (b(a(h)) * self.scaling[name]).to(result.dtype)
            return result

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            raise ValueError(
                f"cannot merge a LoRA adapter into AutoXLA's quantized linear "
                f"({self.get_base_layer()!r}): its int8 / int4 codes cannot take the float "
                "update in place. Save the adapter (save_adapter) and merge it into the float "
                "checkpoint on the host, quantized again if wanted (merge_checkpoint, or "
                "`autoxla merge FLOAT_DIR ADAPTER_DIR OUT --bits N`)")

        def unmerge(self) -> None:
            return None          # never merged

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    return QuantizedLoraLinear
