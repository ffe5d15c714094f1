"""The five steps every entry point runs: resolve, plan, load, patch, wrap (DESIGN.md section 1)."""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import backend, generation, moe, runtimes
from ..attention.config import TRANSFORMERS_NAMES, AttentionConfig
from ..attention.hf import register as register_attention
from ..attention.patch import apply_attention, plan_attention, set_decoder_attention
from ..generation import compile_cache
from ..loading import checkpoint as ckpt
from ..loading.execute import load, place
from ..planning.plan import Plan, build_plan
from ..quantization import ModelQuantizer, sensitivity
from ..sharding.decoder_stack import find_stack
from ..sharding.mesh import MeshShape, mesh_shape_for
from ..state import state_of
from . import dynamic_cache
from . import wrap as wrapping
from .choices import Choices, choose
from .empty import check_sizes, load_config, parameters_on_meta
from .options import LoadOptions
from .scan import stack_decoder

logger = logging.getLogger("AutoXLA")


@dataclass
class Resolved:
    config: Any
    model: nn.Module            # parameters on meta, buffers on the CPU
    dtype: torch.dtype
    tied: dict[str, str]        # target name -> source name
    quantization: Any = None    # the QuantizationReport the model is quantized by, or None
    choices: Choices | None = None   # what the user asked, decided once (modeling/choices.py)


def resolve(path, auto_class, opts: LoadOptions, choices: Choices | None = None) -> Resolved:
    """Step 1: config, what the user asked decided against it (``choose``, unless ``choices`` is
    given), and an empty model of the right class (no weights read).

    ``auto_class`` is a transformers auto class, a sequence of them tried in order (the first
    whose mapping knows the config's type is used), or a function of the config that returns one.
    """
    config, unused = load_config(
        path, trust_remote_code=opts.trust_remote_code, return_unused_kwargs=True,
        **opts.hub_kwargs, **opts.config_kwargs)
    if unused:
        raise TypeError(
            f"from_pretrained() got unexpected keyword argument(s) {sorted(unused)}: they are "
            "neither AutoXLA options (sharding_strategy, mesh, auto_shard, use_fsdp_wrap, "
            "auto_wrap_policy, shard_output_callable, gradient_checkpointing, verbose, dtype, "
            "attn_implementation, attention_config, do_quant, quantization_config, calibration, "
            "xla_patch_linear, generation_options, compile_cache, scan_layers, multislice, "
            "runtime) nor "
            "fields of the model's config; check the spelling")
    choices = choices or choose(config, opts)
    # The model's own attention ("eager": no TPU kernel) is transformers' eager code on the xla
    # runtime; on the dtensor runtime it is transformers' default for the model (SDPA where the
    # model supports it: PyTorch's fused kernels, as a user of plain transformers gets)
    own = choices.attention == "eager" and opts.runtime == "dtensor"
    config._attn_implementation = None if own else choices.attention
    moe.use_for(config)     # static-shape mixture-of-experts layers (moe.py)
    if choices.attention != "eager":
        register_attention()   # transformers must know the name before the model is built
        set_decoder_attention(config, TRANSFORMERS_NAMES[choices.attention])
    if isinstance(auto_class, (tuple, list)):
        auto_class = pick_auto_class(auto_class, config)
    elif not hasattr(auto_class, "from_config"):     # a chooser: config -> auto class
        auto_class = auto_class(config)
    resolved = empty_model(config, auto_class, opts.dtype, opts.trust_remote_code)
    resolved.choices = choices
    return resolved


def pick_auto_class(candidates, config):
    """The first auto class whose mapping holds ``config``'s type, or an error naming them all."""
    for auto_class in candidates:
        if type(config) in getattr(auto_class, "_model_mapping", {}):
            return auto_class
    tried = ", ".join(c.__name__ for c in candidates)
    raise ValueError(f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r}) "
                     f"is not a model any of {tried} can build; this loader takes segmentation "
                     "checkpoints (SAM, SAM2, SAM3, Mask2Former, OneFormer, SegFormer, UperNet, "
                     "...), not text models (AutoXLAModelForCausalLM loads those). For a model "
                     "built some other way, use from_model(model)")


def empty_model(config, auto_class, dtype="auto", trust_remote_code: bool = False) -> Resolved:
    """The model of ``config`` with parameters on meta and buffers on the CPU, and its ties.

    Shared by from_pretrained and ``autoxla plan``, so the plan a user previews is the plan the
    loader executes.
    """
    check_sizes(config)
    dtype = resolve_dtype(dtype, config)
    with parameters_on_meta():
        model = auto_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.eval()
    moe.check_supported(model)
    tied = {}
    if hasattr(model, "get_expanded_tied_weights_keys"):
        tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    return Resolved(config, model, dtype, tied)


def resolve_dtype(dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else torch.float32


def adopt(model: nn.Module, opts: LoadOptions) -> Resolved:
    """Step 1 for from_model: a model that is already built, with its weights (on the CPU)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_model needs a torch.nn.Module, got {type(model).__name__}")
    on = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    if on - {"cpu"}:
        raise ValueError(f"from_model needs the model's weights on the CPU, found them on "
                         f"{sorted(on - {'cpu'})}: build it on the CPU (or call model.cpu()) and "
                         "AutoXLA shards it onto the XLA devices")
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = opts.dtype if isinstance(opts.dtype, torch.dtype) else (
        floating[0] if floating else torch.float32)
    if hasattr(model, "get_expanded_tied_weights_keys"):
        tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    else:   # a plain nn.Module: parameters registered under two names share one tensor
        first, tied = {}, {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[name] = first[id(p)]
            else:
                first[id(p)] = name
    model.eval()
    config = getattr(model, "config", None)
    # A model the user quantized (ModelQuantizer) carries the report of its decisions.
    return Resolved(config, model, dtype, tied, state_of(model).quantization,
                    choose(config, opts, checkpoint=False))


def patch_linears(model: nn.Module, opts: LoadOptions) -> None:
    """Step 2b: torch_xla's einsum nn.Linear (sharding propagates through it), before the plan.
    Quantized linears are not nn.Linear and keep their own forward."""
    if opts.xla_patch_linear:
        backend.patch_linear_for_spmd(model)


def make_plan(resolved: Resolved, runtime=None):
    """Step 2: the mesh and the plan of every tensor on it, of each attention module's kernel
    and of the decoder stack. The plan is the same whichever ``runtime`` (runtimes/) executes it;
    the runtime counts the devices and builds the mesh the loader fills."""
    runtime = runtime or runtimes.select("xla")
    choices = resolved.choices
    if choices.mesh is not None:
        shape, mesh = runtime.adopt_user_mesh(choices.mesh)
    else:
        shape = mesh_shape_for(choices.strategy, runtime.device_count())
        mesh = runtime.make_mesh(shape, choices.multislice)
    host = runtime.current_host()
    simulated = f"{host.index}/{host.count}" if host.simulated else None
    if simulated:
        warnings.warn(f"AUTOXLA_SIMULATE_HOST={simulated}: this process loads the shards "
                      f"of simulated host {host.index} of {host.count} only; the other devices hold "
                      "NaN, so outputs are not meaningful (a multi-host test setting; unset it to "
                      "run the model)", RuntimeWarning, stacklevel=3)
    plan = plan_for_mesh(resolved, resolved.config, choices.strategy, shape, choices.scan_layers,
                         choices.attention, choices.attention_config, choices.multislice,
                         simulated)
    return plan, mesh


def plan_for_mesh(resolved: Resolved, config, strategy: str, mesh: MeshShape,
                  scan_layers: bool = True, attn_implementation: str = "eager",
                  attention_config=None, multislice=None, simulated_host: str | None = None):
    """The Plan of ``resolved``'s model on ``mesh``, with the attention kernel each layer would
    run (``attention_config``: an AttentionConfig or its dict) and the links of the
    ``multislice`` it spans: the one place a plan is assembled (from_pretrained on either
    runtime, ``autoxla plan`` and the offline forecast all call it)."""
    layer_attention = plan_attention(resolved.model, attn_implementation,
                                     AttentionConfig.from_any(attention_config), mesh)
    return build_plan(resolved.model, config, mesh, strategy, resolved.dtype, resolved.tied,
                      scan_layers=scan_layers, quantization=resolved.quantization,
                      layer_attention=layer_attention, multislice=multislice,
                      simulated_host=simulated_host)


def stack_layers(model: nn.Module, plan: Plan, mesh) -> None:
    """Step 4b: a decoder stack the plan scans gets its layers' tensors stacked (modeling/scan.py).
    The plan checked the layers with the attention kernels it gave them; they are checked again
    as patched, since one compiled step runs them all."""
    if plan.stack is None or not plan.stack.scanned:
        return
    if plan.stack.rechecked(find_stack(model)[1]) != plan.stack:
        raise RuntimeError(f"AutoXLA's plan scans {plan.stack.path}, but its layers differ once "
                           "patched; please report this with the model's config. "
                           "scan_layers=False loads it meanwhile")
    stack_decoder(model, plan.stack, plan, mesh)


def quantize_layers(resolved: Resolved, cfg, on_tpu: bool, calibration=None) -> None:
    """Step 2a: decide which layers are quantized to ``cfg`` (a QuantizationConfig, or None for
    none) and how, then swap in the quantized modules. from_pretrained does this while the model
    is still empty, so the plan shows the quantized tensors and the loader fills them (quantizing
    float weights as they stream); from_model on the built model, whose weights the C engine
    quantizes in place. The decisions are ``resolved.quantization``. ``calibration``: what
    calibrating the float model measured and chose (step 1b), recorded in the decisions.
    """
    if cfg is not None:
        quantizer = ModelQuantizer(cfg)
        report = quantizer.plan(resolved.model, resolved.tied, on_tpu)
        if calibration is not None:
            report.attach_calibration(calibration)
        quantizer.apply(resolved.model, report)
        resolved.quantization = report


def build(path, auto_class, opts: LoadOptions) -> nn.Module:
    """from_pretrained, top to bottom."""
    runtime = runtimes.select(opts.runtime)     # xla (torch_xla) or dtensor (torch.distributed)
    if runtime.name == "xla":
        compile_cache.enable(opts.compile_cache)       # 0. before anything compiles (or $ENV)
    resolved = resolve(path, auto_class, opts)                                       # 1. resolve
    checkpoint = ckpt.locate(path, use_safetensors=opts.use_safetensors, **opts.hub_kwargs)
    qconfig, smoothing, calibration = resolved.choices.quantization, None, None
    if resolved.choices.calibration is not None:           # 1b. float model, calibrated, dropped
        qconfig, smoothing, calibration = calibrate_float(path, auto_class, opts, resolved, checkpoint)
    quantize_layers(resolved, qconfig, runtime.pallas_target(), calibration)   # 2a. quantize
    patch_linears(resolved.model, opts)                                     # 2b. einsum linears
    plan, mesh = make_plan(resolved, runtime)                                        # 2. plan
    if opts.verbose:
        print(plan)
    load(resolved.model, plan, mesh, checkpoint, opts.verbose, smoothing,  # 3. load (+ quantize)
         runtime=runtime)
    if runtime.name == "dtensor":       # 4. each module gathers its shards as it runs
        model = runtime.finish(resolved.model, plan, mesh, opts.gradient_checkpointing)
        if plan.attention is not None:                          # 6. fixed-shape generation
            generation.attach(model, opts.generation_options)
        return model
    return _finish(resolved, plan, mesh, opts)                              # 4. patch, 5. wrap


def calibrate_float(path, auto_class, opts: LoadOptions, resolved: Resolved, checkpoint):
    """Step 1b (calibration=...): load the float model sharded (eager attention, no scan, no
    quantization), calibrate it, smooth it and measure each layer (quantization/sensitivity.py),
    then free it. Returns (the QuantizationConfig to quantize with, the smoothing the loader
    applies to the checkpoint's tensors, the CalibrationReport). Costs a second read of the
    checkpoint instead of a second copy of the model on the devices."""
    import gc

    if getattr(resolved.config, "quantization_config", None) is not None:
        raise ValueError(f"calibration=... needs a float checkpoint, but {path} is already "
                         "quantized (its config.json has quantization_config): calibrate when "
                         "quantizing its float checkpoint, or load this one without calibration")
    if not (hasattr(resolved.model, "can_generate") and resolved.model.can_generate()):
        raise ValueError(f"calibration=... scores next tokens, but {type(resolved.model).__name__} "
                         "is not a language model; quantize it without calibration")
    calibration = resolved.choices.calibration
    tokenizer = _tokenizer(path, opts) if calibration.needs_tokenizer else None
    floating = resolve(path, auto_class, opts, resolved.choices.for_float_model())
    plan, mesh = make_plan(floating)
    load(floating.model, plan, mesh, checkpoint, False)
    backend.set_global_mesh(mesh)     # results read back are replicated over it
    try:
        return sensitivity.run(floating.model, calibration, resolved.choices.quantization,
                               tokenizer, floating.tied, backend.pallas_target())
    finally:
        del floating
        gc.collect()


def _tokenizer(path, opts: LoadOptions):
    """The checkpoint's tokenizer, for calibration text."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=opts.trust_remote_code,
                                             **opts.hub_kwargs)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"calibration text needs the checkpoint's tokenizer, but none loads from "
                         f"{path} ({type(e).__name__}: {e}). Save the tokenizer with the "
                         "checkpoint, or calibrate on token ids: calibration=torch.tensor([...])"
                         ) from e


def build_from_model(model: nn.Module, opts: LoadOptions) -> nn.Module:
    """from_model, top to bottom: the same steps on a model that already holds its weights."""
    if opts.runtime != "xla":
        raise ValueError("from_model runs on the xla runtime only so far: on runtime="
                         f"{opts.runtime!r}, save the model (save_pretrained) and load it with "
                         "from_pretrained (docs/runtimes.md)")
    compile_cache.enable(opts.compile_cache)           # 0. before anything compiles (or $ENV)
    resolved = adopt(model, opts)                                                    # 1. adopt
    if resolved.choices.calibration is not None:
        raise ValueError("from_model does not calibrate: quantize the model first with "
                         "ModelQuantizer(config).quantize_model(model, calibration=...), or use "
                         "from_pretrained(..., calibration=...)")
    quantize_layers(resolved, resolved.choices.quantization, backend.pallas_target())  # 2a. in C
    patch_linears(resolved.model, opts)                                     # 2b. einsum linears
    plan, mesh = make_plan(resolved)                                                 # 2. plan
    if opts.verbose:
        print(plan)
    place(resolved.model, plan, mesh)                                                # 3. place
    return _finish(resolved, plan, mesh, opts)                              # 4. patch, 5. wrap


def _finish(resolved: Resolved, plan: Plan, mesh, opts: LoadOptions) -> nn.Module:
    model, choices = resolved.model, resolved.choices
    if plan.layer_attention is not None:                                            # 4. patch
        apply_attention(model, plan.layer_attention, choices.attention_config, mesh)
    moe.place(model, plan)                 # 4. mixture-of-experts layers: the plan's split
    stack_layers(model, plan, mesh)                                           # 4b. scan
    if plan.attention is not None:           # 4c. plain forwards: XLA-safe sliding cache layers
        dynamic_cache.install(model)
    model = wrapping.wrap(model, plan, mesh, opts)                                   # 5. wrap
    if plan.attention is not None:                              # 6. fixed-shape generation
        generation.attach(model, opts.generation_options)
    backend.set_global_mesh(mesh)
    return model
