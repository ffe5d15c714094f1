"""XLAOptimizerWrapper: an optimizer whose ``step()`` also ends the step's XLA graph."""
from __future__ import annotations

from .. import backend


class XLAOptimizerWrapper:
    """Wraps a torch optimizer for SPMD training on XLA.

    ``step()`` runs the optimizer's step, then ``torch_xla.sync()``: the forward, backward and
    update traced so far become one program, compiled once and launched asynchronously, and the
    next step starts a new graph (without the cut, the graph would grow across steps).

    No gradient all-reduce is needed or done: under SPMD one process drives every device and the
    gradients XLA computes are already those of the whole global batch (the sharded program
    reduces them itself). ``xm.optimizer_step``, which the original called, all-reduces across
    processes for multi-process data parallelism; under SPMD it has one process and reduces
    nothing.

    ``zero_grad``, ``state_dict``, ``load_state_dict``, ``param_groups``, ``state`` and any other
    attribute are the wrapped optimizer's. Learning-rate schedulers need the optimizer itself:
    ``LambdaLR(wrapper.optimizer, ...)``.
    """

    def __init__(self, optimizer):
        if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
            raise TypeError(f"XLAOptimizerWrapper wraps a torch optimizer (with step() and "
                            f"param_groups), got {type(optimizer).__name__}")
        self.optimizer = optimizer

    def step(self, closure=None):
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        backend.sync()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name):
        # Only reached for names not found above; "optimizer" itself is excluded so that a
        # half-built object (e.g. during unpickling) raises instead of recursing.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"XLAOptimizerWrapper({self.optimizer!r})"
