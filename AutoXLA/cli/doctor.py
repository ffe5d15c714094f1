"""`autoxla doctor [PATH]`: what this machine and a checkpoint can use, and why not.

Sections: versions, the C core (ABI, the ISA it selected), the XLA devices (kind, count, SPMD),
the runtimes usable here (xla, dtensor and its device types),
Pallas, the persistent compilation cache's self-test, whether a long-running process could run
out of memory mappings and, for a checkpoint, which attention kernel each decoder layer can use. ``--selftest`` runs the Pallas kernels themselves (selftest.py). The XLA runtime starts only in child processes with a timeout, so a
runtime that hangs (a TPU held by another process) is reported instead of hanging the command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .. import __version__, _native, runtimes
from ..attention import tpu
from ..attention.config import AttentionConfig
from ..generation import compile_cache as cc
from ..modeling.empty import load_config
from ..runtimes.dtensor.process import device_types
from ..sharding.mesh import mesh_shape_for, normalize_strategy
from . import selftest

_TIMEOUT = 180
_DEVICES = r"""
import json, os
from AutoXLA import backend
backend.ensure_spmd()
import torch_xla.runtime as xr
out = {"pjrt_device": os.environ.get("PJRT_DEVICE", "(unset: torch_xla picks)"),
       "device_type": xr.device_type(), "device_count": backend.device_count(),
       "spmd": bool(xr.is_spmd()), "on_tpu": backend.on_tpu()}
try:
    import torch_xla.experimental.custom_kernel  # noqa: F401 - flash attention's module
    from torch_xla.experimental import splash_attention  # noqa: F401
    out["pallas_import"] = ""
except Exception as e:  # noqa: BLE001 - any import failure is the answer
    out["pallas_import"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0], "AutoXLA": __version__}
    for name in ("torch", "torch_xla", "transformers", "safetensors", "jax"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def native() -> dict:
    try:
        _native._get_lib()
    except _native.NativeError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, "abi_version": _native.ABI_VERSION, "isa": _native.best_isa(),
            "available_isas": _native.available_isas(), "cpus": _native.num_cpus()}


def devices(timeout: float = _TIMEOUT) -> dict:
    """Device kind and count, SPMD and the Pallas imports, from a child process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    try:
        r = subprocess.run([sys.executable, "-c", _DEVICES], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the XLA runtime did not start within {timeout:.0f} s "
                "(a TPU held by another process? check `lsof /dev/accel*` or /dev/vfio)"}
    if r.returncode != 0:
        tail = " ".join((r.stderr or "").strip().splitlines()[-1:]) or f"exit {r.returncode}"
        return {"ok": False, "error": f"the XLA runtime failed to start: {tail}"}
    d = json.loads(r.stdout.strip().splitlines()[-1])
    if not d["on_tpu"]:
        d["pallas"] = f"not on a TPU ({d['device_type']}): the Pallas kernels run only there"
    elif d["pallas_import"]:
        d["pallas"] = f"unavailable: {d['pallas_import']}"
    else:
        d["pallas"] = "available"
    return {"ok": True, **d}


def runtime_report() -> dict:
    """Which runtimes (docs/runtimes.md) can run here and why not, and the dtensor runtime's
    device types. Nothing starts: the answers come from what is installed."""
    import torch

    out = {"default": runtimes.default()}
    for name in runtimes.NAMES:
        out[name] = {"why_not": runtimes.unavailable(name)}
    out["dtensor"]["device_types"] = device_types()
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    out["dtensor"]["torch"] = torch.__version__
    out["dtensor"]["note"] = (
        "" if (2, 11) <= version <= (2, 15) else
        f"torch {torch.__version__} is outside TorchTPU's range (2.11 to 2.15); the dtensor "
        "runtime is tested on 2.14.1 (./run dtensor, requirements-dtensor.lock)")
    return out


def compile_cache(directory: str | None) -> dict:
    directory = directory or os.environ.get(cc.ENV)
    scratch = None
    if directory is None:          # a throwaway directory: the runtime's answer, nothing kept
        scratch = tempfile.TemporaryDirectory(prefix="autoxla-doctor-")
        directory = scratch.name
    try:
        works, detail = cc.self_test(directory)
    finally:
        if scratch is not None:
            scratch.cleanup()
    return {"directory": None if scratch else directory, "reads_back": works, "detail": detail}


# Memory mappings one compiled XLA:CPU program keeps while torch_xla's in-memory cache holds it:
# about 10 for a single operation, 87 for the tiny Llama's forward on 8 devices (measured: 20
# programs, 1,740 mappings), more for larger programs (one per compiled kernel).
MAPPINGS_PER_PROGRAM = 90
# torch_xla's in-memory compile cache, in programs, unless XLA_COMPILATION_CACHE_SIZE says.
TORCH_XLA_CACHE_SIZE = 2048


def mappings(max_map_count_file: str = "/proc/sys/vm/max_map_count",
             environ: dict | None = None) -> dict:
    """Whether the programs torch_xla may keep can exhaust the kernel's limit on memory mappings
    (vm.max_map_count): when they do, mmap fails inside XLA and the process dies (SIGSEGV or
    SIGABRT in a sync) after hundreds of programs, which a server or a test suite compiles."""
    environ = os.environ if environ is None else environ
    try:
        with open(max_map_count_file) as f:
            limit = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return {"max_map_count": None, "warning": "", "detail": "vm.max_map_count unknown (not "
                "Linux?): nothing to check"}
    raw = environ.get("XLA_COMPILATION_CACHE_SIZE")
    size = int(raw) if raw and raw.strip().isdigit() else TORCH_XLA_CACHE_SIZE
    source = "XLA_COMPILATION_CACHE_SIZE" if raw and raw.strip().isdigit() else "torch_xla's default"
    need = size * MAPPINGS_PER_PROGRAM
    safe = max(limit // (2 * MAPPINGS_PER_PROGRAM), 1)
    detail = (f"compile cache holds up to {size} programs ({source}), about "
              f"{MAPPINGS_PER_PROGRAM} mappings each on XLA:CPU: up to {need:,} of "
              f"vm.max_map_count {limit:,}")
    warning = ""
    if need > limit:
        warning = (f"a long-running process (a server, a test suite, training over many shapes) "
                   f"can run out of memory mappings after about {limit // MAPPINGS_PER_PROGRAM} "
                   f"compiled programs and die inside XLA; set XLA_COMPILATION_CACHE_SIZE={safe} "
                   f"or raise the limit (sysctl -w vm.max_map_count={need * 2})")
    return {"max_map_count": limit, "cache_size": size, "cache_size_source": source,
            "mappings_needed": need, "warning": warning, "detail": detail}


def attention(path, seq_len: int | None = None, batch: int | None = None,
              strategy: str = "fsdp", device_count: int = 8, attention_config=None) -> dict:
    """For each decoder layer of the checkpoint's config: can xla_flash_attention and
    splash_attention take it on a TPU, and if not, why (the checks attention/hf.py makes before
    calling a kernel; the portable path runs instead)."""
    config = load_config(os.fspath(path))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cfg = AttentionConfig.from_any(attention_config) if attention_config else AttentionConfig()
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if not heads or not hidden:
        raise ValueError(f"{path}'s config has no num_attention_heads / hidden_size: not a "
                         "transformer decoder whose attention kernels AutoXLA chooses")
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    layers = getattr(text, "num_hidden_layers", 0)
    seq_len = seq_len or getattr(text, "max_position_embeddings", None)
    mesh_shape_for(normalize_strategy(strategy), device_count)   # refuses a bad strategy here
    softcap = getattr(text, "attn_logit_softcapping", None)
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    rows = []
    for i in range(layers):
        sliding = (types[i] == "sliding_attention") if types else window is not None
        w = window if sliding else None
        flash = [] if tpu.flash_supports(w, softcap) else [
            "no sliding window in flash" if w is not None else "no logit soft-cap in flash"]
        if w is not None and softcap is not None:
            flash = ["no sliding window or logit soft-cap in flash"]
        length = tpu.splash_length(seq_len, cfg) if seq_len else None
        splash = "yes" if length in (None, seq_len) else f"yes, padded to {length} positions"
        rows.append({"layer": i, "window": w, "softcap": softcap,
                     "xla_flash_attention": "yes" if not flash else "; ".join(flash),
                     "splash_attention": splash})
    lanes = ("" if head_dim % 128 == 0 else
             f"head_dim {head_dim} is not a multiple of the TPU's 128 lanes: the Pallas kernels "
             "take it (no check refuses it) but pad each head to the lanes, so part of every "
             "vector op is idle; not measured here (no TPU)")
    return {"path": os.fspath(path), "model_type": getattr(text, "model_type", "?"),
            "head_dim": head_dim, "heads": heads,
            "kv_heads": getattr(text, "num_key_value_heads", heads), "seq_len": seq_len,
            "batch": batch, "strategy": strategy, "head_dim_note": lanes, "layers": rows}


def collect(path=None, seq_len=None, batch=None, strategy="fsdp", cache_dir=None,
            timeout: float = _TIMEOUT) -> dict:
    out = {"versions": versions(), "native": native(), "devices": devices(timeout),
           "runtimes": runtime_report()}
    if out["runtimes"]["xla"]["why_not"] is None:
        out["compile_cache"] = compile_cache(cache_dir)
    else:   # torch_xla's cache: nothing to test without it (the dtensor runtime's environment)
        out["compile_cache"] = {"directory": None, "reads_back": False,
                                "detail": f"not tested: {out['runtimes']['xla']['why_not']}"}
    out["mappings"] = mappings()
    if path is not None:
        count = out["devices"].get("device_count") or 8
        out["attention"] = attention(path, seq_len, batch, strategy, count)
    return out


def describe(r: dict) -> str:
    v = r["versions"]
    lines = ["versions"] + [f"  {k}: {v[k] or 'not installed'}" for k in v]
    n = r["native"]
    lines.append("C core")
    lines += ([f"  ABI version {n['abi_version']}, ISA selected: {n['isa']} (available: "
               f"{', '.join(n['available_isas'])}), {n['cpus']} CPUs"] if n["ok"]
              else [f"  NOT LOADED: {n['error']}"])
    d = r["devices"]
    lines.append("devices")
    if d["ok"]:
        lines += [f"  PJRT_DEVICE={d['pjrt_device']}: {d['device_count']} {d['device_type']} "
                  f"device(s), SPMD {'on' if d['spmd'] else 'off'}",
                  f"  Pallas: {d['pallas']}"]
    else:
        lines.append(f"  {d['error']}")
    rt = r["runtimes"]
    lines.append(f"runtimes (from_pretrained(runtime=...); default here: {rt['default']})")
    for name in ("xla", "dtensor"):
        why = rt[name]["why_not"]
        lines.append(f"  {name}: {'usable' if why is None else 'NOT usable: ' + why}")
    kinds = rt["dtensor"]["device_types"]
    lines.append("  dtensor device types: " + "; ".join(
        f"{k}: {'yes' if v is None else 'no (' + v + ')'}" for k, v in kinds.items()))
    if rt["dtensor"]["note"]:
        lines.append(f"  note: {rt['dtensor']['note']}")
    c = r["compile_cache"]
    where = c["directory"] or "a scratch directory"
    lines += ["persistent compilation cache",
              f"  {'reads back' if c['reads_back'] else 'does NOT read back (stays off)'} in "
              f"{where}: {c['detail']}"]
    m = r["mappings"]
    lines += ["memory mappings", f"  {m['detail']}"]
    if m["warning"]:
        lines.append(f"  WARNING: {m['warning']}")
    a = r.get("attention")
    if a:
        batch = "" if a["batch"] is None else f", batch {a['batch']}"
        lines += [f"attention kernels of {a['path']} ({a['model_type']}, head_dim {a['head_dim']}, "
                  f"{a['heads']} heads / {a['kv_heads']} kv heads, sequence {a['seq_len']}{batch}, "
                  f"{a['strategy']}; on a TPU, else the portable path runs)"]
        if a["head_dim_note"]:
            lines.append(f"  note: {a['head_dim_note']}")
        for row in _grouped(a["layers"]):
            label = "layers" if "-" in row["span"] or "," in row["span"] else "layer"
            lines.append(f"  {label} {row['span']}: xla_flash_attention: {row['xla_flash_attention']}"
                         f"; splash_attention: {row['splash_attention']}")
    return "\n".join(lines)


def _grouped(rows: list[dict]) -> list[dict]:
    """Layers with the same answers, as one line ("0-31" or "0, 2, 4")."""
    groups: dict[tuple, list[int]] = {}
    for row in rows:
        key = (row["xla_flash_attention"], row["splash_attention"])
        groups.setdefault(key, []).append(row["layer"])
    out = []
    for (flash, splash), idx in groups.items():
        span = f"{idx[0]}-{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) and len(idx) > 1 \
            else ", ".join(map(str, idx))
        out.append({"span": span, "xla_flash_attention": flash, "splash_attention": splash})
    return out


def add_arguments(p) -> None:
    p.add_argument("path", nargs="?", help="checkpoint directory or config.json: which attention "
                   "kernels its layers can use")
    p.add_argument("--seq", type=int, default=None, help="sequence length to check the kernels "
                   "for (default: the config's max_position_embeddings)")
    p.add_argument("--batch", type=int, default=None, help="batch size to check splash for")
    p.add_argument("--strategy", default="fsdp", help="fsdp, dp, mp, 2d or 3d (default fsdp)")
    p.add_argument("--compile-cache", default=None, help="self-test the cache in DIR (default "
                   "$AUTOXLA_COMPILE_CACHE, else a scratch directory)")
    p.add_argument("--timeout", type=float, default=_TIMEOUT, help="seconds the XLA runtime may "
                   f"take to start (default {_TIMEOUT})")
    p.add_argument("--json", action="store_true", help="print JSON instead of the report")
    p.add_argument("--selftest", action="store_true", help="run a tiny model through every "
                   "Pallas kernel path against eager (off a TPU: the emulated kernels, which "
                   "need jax); pass or fail with the numbers")


def run(args) -> int:
    if args.selftest:
        where, checks = selftest.run()
        if args.json:
            print(json.dumps({"where": where, "checks": [dict(vars(c), ok=c.ok) for c in checks]},
                             indent=1))
        else:
            print(selftest.describe(where, checks))
        return 0 if all(c.ok for c in checks) else 1
    for name in ("seq", "batch", "timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name} {value}: pass a positive number")
    path = args.path
    if path is not None:
        if os.path.isfile(path):
            path = os.path.dirname(os.path.abspath(path))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{args.path} has no config.json: pass a checkpoint directory "
                                    "or its config.json")
    r = collect(path, args.seq, args.batch, args.strategy, args.compile_cache, args.timeout)
    print(json.dumps(r, indent=1) if args.json else describe(r))
    # usable: the C core, and the XLA devices or, without torch_xla, the dtensor runtime
    rt = r["runtimes"]
    runnable = r["devices"]["ok"] or (rt["xla"]["why_not"] is not None
                                      and rt["dtensor"]["why_not"] is None)
    return 0 if r["native"]["ok"] and runnable else 1
