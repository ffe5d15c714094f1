"""`autoxla serve` as a user starts it: one process of its own for the module (it loads, compiles
with its progress bar, answers the openai client and raw HTTP on loopback), then what a client
can do to a server: bodies too large or slow, bad JSON and types, requests that can never be
admitted, tiny temperatures, clients that hang up or send their headers a byte at a time, and a
Ctrl-C with requests in flight (last: it stops the process). Every request is bounded (its own
timeout); the whole module takes about a minute, most of it the process's start."""
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from .test_server import free_port

MAX_QUEUE = 8
HEADER_TIMEOUT = 1.0
MAX_CONNECTIONS = 16
DRAIN_SECONDS = 3.0
MAX_TOKENS = 128
BODY_LIMIT = 1 << 20     # the default: 16 bytes x 8 queued x 32 prompt tokens is less than 1 MiB
SERVE_ARGS = ["--devices", "8", "--max-batch", "4", "--max-prompt-tokens", "32",
              "--max-tokens", str(MAX_TOKENS), "--max-queue", str(MAX_QUEUE),
              "--model-name", "tiny", "--header-timeout", str(HEADER_TIMEOUT),
              "--max-connections", str(MAX_CONNECTIONS), "--drain-seconds", str(DRAIN_SECONDS)]


class Command:
    def __init__(self, proc, port, log_path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


@pytest.fixture(scope="module")
def command(chat_checkpoint, tmp_path_factory):
    path, tokenizer = chat_checkpoint
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "out.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "AutoXLA.cli", "serve", str(path),
                                 "--port", str(port), *SERVE_ARGS],
                                stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    served = Command(proc, port, log_path)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, served.log()
            assert time.monotonic() < deadline, "the server did not come up in 5 minutes"
            try:
                if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def post(command, body, path="/v1/completions", timeout=60):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(command.url + path, content=content, timeout=timeout,
                      headers={"content-type": "application/json"})


def connect(command, timeout=10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", command.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def head(length=None, chunked=False, path="/v1/completions", expect=False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    if expect:
        lines.append("Expect: 100-continue")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length body, from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    top, body = data.split(b"\r\n\r\n", 1)
    lines = top.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        assert chunk, "the connection closed inside the body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes ``s`` within ``within`` seconds (anything it sends is read)."""
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def metric(command, name: str) -> float:
    text = httpx.get(command.url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def health(command) -> dict:
    return httpx.get(command.url + "/health", timeout=10).json()


def wait_until(condition, seconds: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


def test_serve_command_answers_the_openai_client(command):
    from openai import OpenAI

    with OpenAI(base_url=command.url + "/v1", api_key="unused", max_retries=0) as api:
        answer = api.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": "Hi!"}])
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.completion_tokens >= 1
    assert "programs compiled; serving tiny on http://127.0.0.1" in command.log()


@pytest.mark.parametrize("body,status,param,names", [
    # issue 43 item 13: an unknown model is a 404 in OpenAI's shape
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    # strict types: no "5" -> 5, no true -> 1, no booleans as token ids
    ({"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": True}, 400, "max_tokens", "integer"),
    ({"model": "tiny", "prompt": [True, False]}, 400, "prompt", "token ids"),
    ({"model": "tiny", "prompt": "hi", "stream": 1}, 400, "stream", "boolean"),
    # bounded penalties, and NaN / Infinity named as what they are
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 1e-300}, 400, "repetition_penalty",
     "0.01"),
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 1e6}, 400, "repetition_penalty",
     "100"),
    (b'{"model": "tiny", "prompt": "hi", "repetition_penalty": Infinity}', 400,
     "repetition_penalty", "finite number"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature",
     "finite number"),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", "2"),
])
def test_strict_types_bounded_penalties_and_unknown_models(command, body, status, param, names):
    r = post(command, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and names in json.dumps(error), error
    if status == 404:
        assert error["code"] == "model_not_found" and "tiny" in error["message"]
    if b"NaN" in (body if isinstance(body, bytes) else b""):
        assert "less than" not in error["message"], error


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "a \\ud800 b", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", '
                             b'"content": "\\udc00"}], "max_tokens": 2}'),
])
def test_a_lone_surrogate_is_a_400_not_a_500(command, path, raw):
    """Issue 43 item 7: a lone surrogate escape is not Unicode: a 400, and nothing in the log."""
    r = post(command, raw, path=path)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
    assert "Traceback" not in command.log()


def test_a_request_that_can_never_be_admitted_is_a_400_naming_the_limit(command):
    """Issue 43 item 8: more sequences than the queue holds is a 400, not a 429 forever."""
    r = post(command, {"model": "tiny", "prompt": ["a"] * 3, "n": 3, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "--max-queue" in error["message"] and "9 sequences" in error["message"], error
    assert "retry-after" not in r.headers
    r = post(command, {"model": "tiny", "prompt": ["a"] * 4, "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8      # exactly the bound: fine


def test_tiny_temperatures_answer_as_greedy(command):
    """Issue 43 item 9: 1e-38 (subnormal in float32) and 1e-46 (0 in float32) with a seed gave
    token 1 every time; below 1e-5 a temperature is greedy: the tokens of temperature 0."""
    def ask(temperature):
        r = post(command, {"model": "tiny", "prompt": "Hello there, how", "max_tokens": 8,
                           "temperature": temperature, "seed": 7, "logprobs": 1,
                           "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]

    greedy = ask(0)
    for temperature in (1e-38, 1e-46, 1e-6, 1e-30):    # 1e-30 samples: another step program
        text, tokens, logprobs = ask(temperature)
        assert (text, tokens) == greedy[:2], temperature
        assert logprobs == pytest.approx(greedy[2], abs=1e-4), temperature


def test_a_body_over_the_limit_is_refused_before_it_is_read(command):
    """Issue 43 item 6: a 50 MB body is refused from its Content-Length with a JSON 413 naming
    the limit and its option, before the rest is sent; a chunked one as soon as its chunks pass
    the limit; /health answers while a slow upload is in progress; and a prompt whose first
    characters already exceed the token limit is refused without tokenizing the rest."""
    with connect(command) as s:                      # declared, Expect: refused on the headers
        s.sendall(head(50_000_000, expect=True))
        status, headers, body = read_response(s)
        assert status == 413, body
        error = json.loads(body)["error"]
        assert str(BODY_LIMIT) in error["message"] and "--max-body-bytes" in error["message"]
        assert headers.get("connection") == "close" and closed_by_server(s, 5)
    # A client that writes its whole body before reading (http.client, httpx, the openai client)
    # reads the 413 too: the server drops the rest of the body instead of resetting the
    # connection under the client's write (before, "connection reset by peer").
    import http.client
    client = http.client.HTTPConnection("127.0.0.1", command.port, timeout=30)
    client.request("POST", "/v1/completions", body=b'{"model": "tiny", "prompt": "'
                   + b"x" * 50_000_000 + b'"}', headers={"Content-Type": "application/json"})
    answer = client.getresponse()
    assert answer.status == 413 and "--max-body-bytes" in json.loads(answer.read())["error"]["message"]
    client.close()
    with connect(command) as s:                      # chunked: refused once past the limit
        s.sendall(head(chunked=True))
        chunk = b"x" * (256 * 1024)
        for _ in range(5):                            # 1.25 MiB, and no last chunk
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, _, body = read_response(s)
        assert status == 413 and "--max-body-bytes" in json.loads(body)["error"]["message"]
    with connect(command) as s:                      # a slow upload does not hold the others
        s.sendall(head(300_000) + b'{"model": "tiny", "prompt": "')
        for _ in range(3):
            s.sendall(b"word " * 2000)
            assert health(command)["status"] == "ok"
            time.sleep(0.2)
    text = "word " * ((BODY_LIMIT - 1000) // 5)     # under the body limit, 200k tokens
    r = post(command, {"model": "tiny", "prompt": text, "max_tokens": 2})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    # the first 16 x 33 characters were enough to refuse it
    assert "first" in message and "characters already have" in message, message
    assert "--max-prompt-tokens" in message
    assert health(command)["status"] == "ok"


def test_non_stream_clients_that_hang_up_free_their_slots(command):
    """Issue 43 item 11: whole (non-stream) requests whose clients close their connection are
    cancelled at once, running or queued, as streams are; none runs to its max_tokens."""
    aborted = 'autoxla_sequences_finished_total{reason="abort"}'
    before_abort, before_tokens = metric(command, aborted), metric(
        command, "autoxla_generated_tokens_total")
    body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    sockets = []
    try:
        for _ in range(6):                           # 4 slots: 4 running, 2 queued
            s = connect(command)
            s.sendall(head(len(body)) + body)
            sockets.append(s)
        assert wait_until(lambda: health(command)["slots_in_use"] == 4, 30)
    finally:
        for s in sockets:
            s.close()
    assert wait_until(lambda: health(command)["slots_in_use"] == 0
                      and health(command)["queue_depth"] == 0, 10)
    assert metric(command, aborted) == before_abort + 6
    generated = metric(command, "autoxla_generated_tokens_total") - before_tokens
    assert generated < 4 * MAX_TOKENS, generated


def test_past_the_connection_limit_a_request_gets_a_json_503(command):
    """Issue 43 item 12: past --max-connections a request gets a JSON 503 naming the option;
    once the idle connections are closed (--header-timeout), requests are answered again."""
    idle = [connect(command) for _ in range(MAX_CONNECTIONS)]
    try:
        r = post(command, {"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=10)
        assert r.status_code == 503, r.text
        assert "--max-connections" in r.json()["error"]["message"]
    finally:
        for s in idle:
            s.close()
    assert wait_until(lambda: post(command, {"model": "tiny", "prompt": "hi", "max_tokens": 1},
                                   timeout=10).status_code == 200, 10)


def test_slow_header_connections_are_closed_after_the_header_timeout(command):
    """Issue 43 item 12: a connection that sends nothing, or its headers a byte at a time, is
    closed after --header-timeout (uvicorn has no such timer before a first response)."""
    silent = [connect(command) for _ in range(5)]
    slow = [connect(command) for _ in range(5)]
    try:
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        started = time.monotonic()
        sent = 0
        while time.monotonic() - started < 3 * HEADER_TIMEOUT and sent < len(request):
            for s in slow:
                try:
                    s.send(request[sent:sent + 1])
                except OSError:
                    pass
            sent += 1
            time.sleep(HEADER_TIMEOUT / 5)
        assert all(closed_by_server(s, 3 * HEADER_TIMEOUT) for s in silent + slow)
        assert time.monotonic() - started < 8 * HEADER_TIMEOUT
    finally:
        for s in silent + slow:
            s.close()
    assert health(command)["status"] == "ok"


def stream_events(command, body: dict) -> list:
    """A stream's events: parsed JSON, or "[DONE]"."""
    out = []
    with httpx.stream("POST", command.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_shutdown_refuses_at_once_drains_then_ends_every_request_properly(command):
    """Issue 43 item 10, last (it stops the process): after SIGINT a new request, on a new
    connection, is a JSON 503 at once; a short running request finishes; after --drain-seconds
    every stream still running ends with finish_reason "abort", an error event and [DONE], and
    every whole request gets a JSON 503; the process exits 0 with no traceback."""
    long = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # admitted first (the queue is first come first served): its 24 tokens fit the drain
        short = pool.submit(post, command, {**long, "max_tokens": 24})
        assert wait_until(lambda: health(command)["slots_in_use"] == 1, 30)
        streams = [pool.submit(stream_events, command, long) for _ in range(3)]
        wholes = [pool.submit(post, command, long) for _ in range(3)]
        # 4 slots and 7 requests: 3 wait for 128 steps of the first ones, far past the drain;
        # every one of them is in (running or queued) before the signal

        def all_in():
            h = health(command)
            return h["slots_in_use"] + h["queue_depth"] >= 6 + (not short.done())
        assert wait_until(all_in, 30)
        command.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        refused = post(command, {"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503, refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(command.url + "/health", timeout=5).status_code == 503
        answer = short.result(timeout=60)
        assert answer.status_code == 200 and \
            answer.json()["choices"][0]["finish_reason"] == "length"
        cut = 0
        for future in streams:
            events = future.result(timeout=60)
            assert events[-1] == "[DONE]", events[-3:]
            reasons = [c["finish_reason"] for e in events[:-1] if "choices" in e
                       for c in e["choices"] if c["finish_reason"]]
            assert len(reasons) == 1, events[-3:]
            if reasons == ["abort"]:
                cut += 1
                assert events[-2]["error"]["code"] == 503, events[-3:]
                assert "--drain-seconds" in events[-2]["error"]["message"]
            else:
                assert reasons == ["length"]
        for future in wholes:
            r = future.result(timeout=60)
            assert r.headers["content-type"] == "application/json", r.text
            if r.status_code == 503:
                cut += 1
                assert "--drain-seconds" in r.json()["error"]["message"]
            else:
                assert r.status_code == 200, r.text
    assert cut >= 2
    out = ""
    try:
        command.proc.wait(timeout=60)
    finally:
        out = command.log()
    assert command.proc.returncode == 0, out
    assert "Traceback" not in out and "Exception in ASGI application" not in out, out
