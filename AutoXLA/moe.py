"""Mixture-of-experts layers with static shapes, through transformers' experts interface.

transformers 5 keeps a model's experts as ``[experts, ...]`` parameters (``gate_up_proj``,
``down_proj``, optional biases) in one module whose forward it looks up by name
(``ExpertsInterface``, like attention). Its own forwards do not suit XLA: "eager" loops over the
experts a batch hits (``nonzero``: data-dependent shapes, a new program per routing), "grouped_mm"
needs a CUDA/CPU kernel, "batched_mm" gathers one weight matrix per (token, choice).

``autoxla_experts`` runs every expert on every token and weights the results by the router's
choices, a [tokens, experts] matrix that is zero outside each token's top k (GShard's dense
dispatch). Shapes never depend on the routing, so generation keeps its 2 programs, and the result
equals transformers' (the same sums, the unchosen experts weighted by exact zeros). The expert
dimension is split over the mesh (sharding/rules.py, role "experts"): each device computes only
its own experts, and XLA sums their weighted outputs across devices. The cost: each device does
``experts / (top_k x expert shards)`` times the arithmetic of the chosen experts; for decode
(few tokens, bound by reading the weights, which each device reads once either way) that is what
any dispatch pays, for long prefills it is the price of exactness (docs/moe.md).
"""
from __future__ import annotations

import torch
from torch import nn

from . import backend
from .sharding import rules

NAME = "autoxla_experts"


def register() -> None:
    """Registers ``autoxla_experts`` with transformers' ExpertsInterface; idempotent."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, dense_experts_forward)


def use_for(config) -> None:
    """Make ``config`` (and its sub-configs) ask for ``autoxla_experts``."""
    register()
    config._experts_implementation = NAME


def use_on(module: nn.Module) -> None:
    """Make one experts module (and every module sharing its config) run ``autoxla_experts``."""
    if getattr(module, "config", None) is not None:
        register()
        module.config._experts_implementation = NAME


def check_supported(model: nn.Module) -> None:
    """Refuse, at load, an experts module ``autoxla_experts`` cannot run, naming it and why."""
    for name, module in model.named_modules():
        if rules.is_experts(module) and getattr(module, "has_post_expert_norm", False):
            raise ValueError(
                f"{name} ({type(module).__name__}) normalises each expert's output, which "
                "AutoXLA's static-shape experts do not implement yet; this architecture cannot be "
                "loaded by AutoXLA (docs/models.md lists the supported ones)")


def place(model: nn.Module, plan) -> None:
    """Give each experts module ``autoxla_experts`` (a model built by the user and passed to
    from_model asked for another), and where the plan split its experts over fsdp, tell it to
    keep its intermediates split that way (``autoxla_dispatch_spec``)."""
    by_expert = plan.split_by_expert()
    for name, module in model.named_modules():
        if not rules.is_experts(module):
            continue
        use_on(module)
        leaf = "gate_up_proj" if module.has_gate else "up_proj"
        if {f"{name}.{leaf}", f"{name}.{leaf}.weight"} & by_expert:
            module.autoxla_dispatch_spec = (None, "fsdp", None)


def dense_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states [tokens, hidden], top_k_index / top_k_weights [tokens, k] -> [tokens, hidden].

    Follows the layout flags transformers' decorator sets on the experts module: ``has_gate``
    (gate_up_proj, else up_proj), ``is_transposed`` (weights [E, in, out], gpt-oss) and
    ``has_bias``; the gate itself is the module's ``_apply_gate`` (gpt-oss interleaves gate and
    up and clamps), applied on the last dimension. A quantized projection (``QuantizedExperts``,
    do_quant) is dequantized here, inside the compiled graph. Modules with ``has_post_expert_norm`` are
    refused at load (``check_supported``)."""
    experts, transposed = _weight(self, "gate_up_proj" if self.has_gate else "up_proj",
                                  hidden_states.dtype)
    down_proj, down_transposed = _weight(self, "down_proj", hidden_states.dtype)
    num_experts = experts.shape[0]
    routing = routing_matrix(top_k_index, top_k_weights, num_experts)
    # Expert parallelism (the plan's choice, set by ``place``): the [tokens, experts, ...]
    # intermediates stay split by expert, so the tokens travel to the experts rather than
    # the experts' weights to the tokens (which XLA chose for the backward when left alone).
    split = getattr(self, "autoxla_dispatch_spec", None)
    up = _experts_linear(hidden_states, experts, transposed)                  # [T, E, 2I or I]
    if self.has_bias:
        up = up + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)
    if split:
        up = backend.constrain(up, split)
    inner = self._apply_gate(up) if self.has_gate else self.act_fn(up)       # [T, E, I]
    down = _experts_linear(inner, down_proj, down_transposed, per_expert=True)  # [T, E, H]
    if self.has_bias:
        down = down + self.down_proj_bias
    if split:
        down = backend.constrain(down, split)
    out = torch.einsum("teh,te->th", down, routing.to(down.dtype))
    return out.to(hidden_states.dtype)


def routing_matrix(top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   num_experts: int) -> torch.Tensor:
    """routing[t, e]: the weight token t gives expert e, 0 for the experts it did not choose
    (top_k_index / top_k_weights [tokens, k] -> [tokens, experts]).

    A comparison with each expert's number, not a scatter: XLA's SPMD partitioner scatters the
    padding of an unevenly split index tensor into row 0. transformers' routers leave their
    [tokens, k] outputs split on k whenever the router's bias is split over more devices than
    k (gpt-oss: 4 experts over fsdp=4, top-2, the batch not dividing data x fsdp), and a scatter
    there silently added garbage to the first token's routing: row 0's logits were wrong at
    every position (issue 43). The chosen experts are distinct, so each entry is one weight
    plus exact zeros: the same numbers as transformers' scatter, and no scatter on a TPU.
    """
    experts = torch.arange(num_experts, device=top_k_index.device)
    chosen = top_k_index.long().unsqueeze(-1) == experts                  # [T, k, E]
    return (chosen.to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)).sum(dim=1)


def _weight(module: nn.Module, leaf: str, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(the projection's [E, ...] weight, whether it is [E, in, out]): a float parameter as the
    module holds it, or a QuantizedExperts' (quantization/experts.py) dequantized in the graph,
    always [E, out, in]."""
    weight = getattr(module, leaf)
    if isinstance(weight, nn.Module):
        return weight.dequantized_weight(dtype), False
    return weight, module.is_transposed


def _experts_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool,
                    per_expert: bool = False) -> torch.Tensor:
    """Every expert's linear: x [T, in] (or [T, E, in] with ``per_expert``) times weight
    [E, out, in] ([E, in, out] when ``transposed``) -> [T, E, out]."""
    lhs = "tei" if per_expert else "ti"
    rhs = "eio" if transposed else "eoi"
    return torch.einsum(f"{lhs},{rhs}->teo", x, weight)
