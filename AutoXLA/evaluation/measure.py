"""Compile a real step in a child process with XLA's dump on, and read what XLA made of the
plan: its collectives and buffer sizes (the parsing is planning/hlo.py; the forecasts it is
compared with are planning/communication.py and planning/memory.py).

XLA reads its dump flags once per process, when its runtime starts: a step is compiled in a
fresh interpreter with XLA_FLAGS set, and its partitioned module read from the dump directory.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from .. import backend
from ..modeling import AutoXLAModelForCausalLM, wrap
from ..planning.hlo import BufferStats, Collective, buffer_stats, collectives, parameter_buffers
from ..state import state_of


@dataclass
class Measured:
    collectives: list[Collective]
    buffers: BufferStats
    module: str               # the dump file read


def measure_step(path, strategy: str, *, batch: int, seq: int, train: bool, dump_dir,
                 replicate_activations: bool = False, megatron_activations: bool = False,
                 free_gradients: bool = False,
                 timeout: float = 600) -> Measured:
    """Compile one training step (forward + backward, no optimizer) or one decode-shaped forward
    (``seq`` tokens, no cache) of the checkpoint at ``path`` on the 8 CPU devices; the collectives
    and buffer sizes of the partitioned program. ``replicate_activations`` injects a sharding
    mistake (every decoder layer's output forced replicated) for tests of the report;
    ``megatron_activations`` compiles Megatron's layout instead of the plan's (the residual
    stream whole on model, logits split by vocabulary), ``free_gradients`` leaves gradients
    unannotated (as before modeling/wrap.py gave them their parameters' sharding): both
    experiments for the bench's side-by-side comparisons."""
    flags = [f for f, on in (("replicate-activations", replicate_activations),
                             ("megatron-activations", megatron_activations),
                             ("free-gradients", free_gradients)) if on]
    dump_dir, _ = _run_child(path, strategy, batch, seq, "train" if train else "decode", flags,
                             dump_dir, timeout)
    # The step is the largest program (loading compiles small ones, if any).
    module = max(_modules(dump_dir), key=os.path.getsize)
    with open(module) as f:
        ops = collectives(f.read())
    with open(module.replace(".txt", "-buffer-assignment.txt")) as f:
        stats = buffer_stats(f.read())
    return Measured(ops, stats, module)


@dataclass
class MeasuredGeneration:
    batch: int                # the batch bucket generate padded to
    length: int               # the KV cache's length (slots)
    programs: list            # (dump file, parameter_buffers, BufferStats), one per program


def measure_generation(path, strategy: str, *, batch: int, prompt: int, dump_dir,
                       timeout: float = 600) -> MeasuredGeneration:
    """``model.generate`` of 3 tokens after a ``prompt``-token prompt, as users run it (scanned
    stack, static KV cache) on the 8 CPU devices; every compiled program's entry parameters and
    buffer sizes, so the KV cache can be found among the decode step's arguments."""
    dump_dir, out = _run_child(path, strategy, batch, prompt, "generate", [], dump_dir, timeout)
    sizes = json.loads(out.strip().splitlines()[-1])
    programs = []
    for module in sorted(_modules(dump_dir)):
        with open(module.replace(".txt", "-buffer-assignment.txt")) as f:
            text = f.read()
        programs.append((module, parameter_buffers(text), buffer_stats(text)))
    return MeasuredGeneration(sizes["batch"], sizes["length"], programs)


def _run_child(path, strategy, batch, seq, mode, flags, dump_dir, timeout):
    """Runs this module as a child with XLA's dump on; (its dump folder, its stdout)."""
    os.makedirs(dump_dir, exist_ok=True)
    dump_dir = tempfile.mkdtemp(prefix=f"{strategy}-", dir=dump_dir)   # never a stale module
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} "
                         "--xla_dump_hlo_as_text")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "AutoXLA.evaluation.measure", os.fspath(path), strategy,
           str(batch), str(seq), mode, *flags]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"compiling the {strategy} {mode} step failed:\n{r.stderr[-3000:]}")
    return dump_dir, r.stdout


def _modules(dump_dir) -> list[str]:
    modules = glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations.txt"))
    if not modules:
        raise RuntimeError(f"XLA wrote no optimized module to {dump_dir}")
    return modules


def _child(path, strategy, batch, seq, mode, *flags):
    dev = backend.device()
    if "megatron-activations" in flags:
        # An experiment, not the plan (modeling/wrap.py says why): the residual stream whole on
        # model (layer outputs and the embedding's lookup batch-split only), logits by vocabulary.
        def megatron(t, mesh, vocab=False):
            s = wrap.activation_spec(t, mesh)
            s = s if s is not None else (None,) * t.dim()
            return tuple(a if (a != "model" or vocab) else None for a in s)

        def shard(out, mesh):
            if isinstance(out, dict):
                items = [(v, k == "logits") for k, v in out.items()
                         if k in ("logits", "last_hidden_state")]
            else:
                items = [(out[0] if isinstance(out, (tuple, list)) else out, False)]
            for t, vocab in items:
                if isinstance(t, torch.Tensor) and t.device.type == "xla":
                    backend.mark_sharding(t, mesh, megatron(t, mesh, vocab))
        wrap.shard_output = shard
    if "free-gradients" in flags:
        wrap._shard_gradients_like_parameters = lambda model, mesh: None
    if "replicate-activations" in flags:
        def replicated(output, mesh):
            t = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(t, torch.Tensor) and t.device.type == "xla":
                backend.mark_sharding(t, mesh, (None,) * t.dim())
        wrap.shard_output = replicated
    if mode == "generate":    # the KV cache as generation allocates and passes it, scanned
        model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy)
        ids = torch.randint(3, 200, (int(batch), int(seq)),
                            generator=torch.Generator().manual_seed(0))
        model.generate(ids, max_new_tokens=3, do_sample=False)
        s = state_of(model).last_generate
        print(json.dumps({"batch": s.batch_bucket, "length": s.cache_length}))
        return
    # Unrolled: a scanned stack's loop body holds one layer's collectives, run L times.
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy,
                                                    scan_layers=False)
    backend.sync()
    if "megatron-activations" in flags:
        mesh = state_of(model).mesh
        model.get_input_embeddings().register_forward_hook(
            lambda _m, _i, out: wrap.shard_output(out, mesh))
    ids = torch.randint(3, 200, (int(batch), int(seq)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    if mode == "train":
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        backend.sync()
    else:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        backend.sync()


if __name__ == "__main__":
    _child(*sys.argv[1:])
