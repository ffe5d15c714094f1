"""Running one measurement in a fresh process on virtual XLA:CPU devices (8 unless told), for the
benchmarks: no side inherits another's compiled programs, and a child that dies is reported, not
fatal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(devices: int = 8) -> dict:
    return dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices),
                TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))


def run_json_child(args: list[str], limit: float, devices: int = 8) -> dict:
    """``python args...``; its last stdout line as JSON, or {"error": why} (time limit, or exit
    code with the last line of stderr)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, *args], env=child_env(devices), capture_output=True,
                             text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"not finished after {limit:.0f} s"}
    if out.returncode != 0:
        tail = [l for l in out.stderr.strip().splitlines() if l.strip()][-1:] or ["?"]
        return {"error": f"process died (exit {out.returncode}) after "
                         f"{time.perf_counter() - t0:.0f} s: {tail[0][:120]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_sampled(cmd: list[str], env: dict, cap_gib: float) -> dict:
    """``cmd`` as a child, its RSS sampled every 20 ms and the child stopped above ``cap_gib``
    (rather than left to the kernel's OOM killer): {"peak_gib", "wall_s"} and its last stdout
    line's JSON, or "error" (stopped, or its exit code and last stderr line)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, stopped, page = 0, "", os.sysconf("SC_PAGE_SIZE")
    while p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/statm") as f:
                peak = max(peak, int(f.read().split()[1]) * page)
        except (OSError, ValueError):
            pass
        if peak > cap_gib * 2**30:
            p.kill()
            stopped = (f"stopped at {peak / 2**30:.1f} GiB RSS (cap {cap_gib} GiB) after "
                       f"{time.perf_counter() - t0:.0f} s")
            break
        time.sleep(0.02)
    stdout, stderr = p.communicate()
    result = {"peak_gib": peak / 2**30, "wall_s": time.perf_counter() - t0}
    if stopped:
        return {**result, "error": stopped}
    if p.returncode != 0:
        tail = (stderr.strip().splitlines() or ["?"])[-1]
        return {**result, "error": f"exit {p.returncode}: {tail[:200]}"}
    return {**result, **json.loads(stdout.strip().splitlines()[-1])}


def decode_checkpoints(models, tmp) -> dict[str, tuple[str, str]]:
    """name -> (checkpoint, tokenizer directory or ""), for the decode benchmarks' ``models``:
    the tiny Llama saved into ``tmp`` (token ids, no tokenizer), the real SmolLM2 (converted once)."""
    sys.path.insert(0, str(ROOT))
    from AutoXLA.testing.real_model import smollm2_checkpoint
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    paths = {}
    if "tiny" in models:
        paths["tiny"] = (str(save_tiny_checkpoint("llama", Path(tmp) / "tiny")), "")
    if "smollm2" in models:
        real = str(smollm2_checkpoint())
        paths["smollm2"] = (real, real)
    return paths
