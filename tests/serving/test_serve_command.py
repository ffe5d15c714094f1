"""`autoxla serve` as a user starts it: a process of its own that loads, compiles with its
progress bar, answers the openai client, and stops cleanly on Ctrl-C (SIGINT) or SIGTERM."""
import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from .test_server import free_port


@pytest.mark.parametrize("stop_with", [signal.SIGINT])
def test_serve_command_answers_and_stops_cleanly(chat_checkpoint, stop_with):
    from openai import OpenAI

    path, tokenizer = chat_checkpoint
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "AutoXLA.cli", "serve", str(path), "--port", str(port),
         "--devices", "8", "--max-batch", "4", "--max-prompt-tokens", "32", "--max-tokens", "16",
         "--model-name", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up in 5 minutes"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        api = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        answer = api.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": "Hi!"}])
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage.completion_tokens >= 1
        proc.send_signal(stop_with)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "programs compiled; serving tiny on http://127.0.0.1" in out, out
    assert "Traceback" not in out, out
