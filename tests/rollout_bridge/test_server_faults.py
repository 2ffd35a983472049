"""The rollout HTTP server against slow, hostile and broken clients, and its lifecycle.

Deadlines (slow and drip-fed bodies and heads, silent connections), parser limits (deep JSON,
huge integers, invalid UTF-8), size limits (413), auth before routing, the API key from the
environment or a file, SGLang-style streaming, keep-alive, graceful stop and cancellation of
abandoned work. The engine is the deterministic `StubEngine` of test_client.py (no model, no
compile): these tests are about the HTTP layer. Timing enters only as deadlines: an answer
must arrive before `deadline + SLACK_S`.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from test_client import StubEngine  # pytest (prepend mode) puts this directory on sys.path

from rollout_bridge import serve
from rollout_bridge.api import ApiError, parse_generate
from rollout_bridge.client import HttpRolloutEngine, RolloutHTTPError, wait_healthy
from rollout_bridge.server import RolloutServer, ServerOptions

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 1.0  # the fixture server's head and body deadlines
SLACK_S = 5.0  # scheduling slack on 2 shared CPU cores
LIMIT = 1 << 20  # the fixture server's body limit
VOCAB = StubEngine().config.vocab_size


@pytest.fixture(scope="module")
def server():
  opts = ServerOptions(batch_window_s=0.002, max_body_bytes=LIMIT, header_timeout_s=DEADLINE_S,
                       body_timeout_s=DEADLINE_S, keep_alive_s=2 * DEADLINE_S)
  srv = RolloutServer(StubEngine(), opts).start()
  try:
    yield srv
  finally:
    srv.stop()


@pytest.fixture(scope="module")
def keyed():
  srv = RolloutServer(StubEngine(), ServerOptions(api_key="k3y")).start()
  try:
    yield srv
  finally:
    srv.stop()


# ------------------------------------------------------------------------------ helpers

def connect(srv: RolloutServer) -> socket.socket:
  return socket.create_connection((srv.host, srv.port), timeout=2 * DEADLINE_S + SLACK_S)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
  """(status, lower-cased headers, parsed JSON body) of the next response on `sock`."""
  resp = http.client.HTTPResponse(sock)
  resp.begin()
  body = resp.read()
  return resp.status, {k.lower(): v for k, v in resp.getheaders()}, (
      json.loads(body) if body else None)


def post(srv: RolloutServer, path: str, body: bytes, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], Any]:
  """One POST of raw `body` (with its Content-Length) on a fresh connection."""
  conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
  try:
    conn.request("POST", path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    ctype = resp.getheader("content-type", "")
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, (
        json.loads(data) if data and ctype.startswith("application/json") else data)
  finally:
    conn.close()


def get(srv: RolloutServer, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
  conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
  try:
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())
  finally:
    conn.close()


def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
  """Polls an observable server state (no event to wait on) until it holds."""
  deadline = time.monotonic() + timeout
  while not cond():
    assert time.monotonic() < deadline, "condition not reached in time"
    time.sleep(0.01)


def drip(sock: socket.socket, data: bytes, interval_s: float, stop: threading.Event) -> None:
  """Sends `data` one byte per `interval_s` until `stop` or the server closes the socket."""
  for i in range(len(data)):
    if stop.wait(interval_s):
      return
    try:
      sock.sendall(data[i:i + 1])
    except OSError:
      return


def gen_body(**kw: Any) -> bytes:
  return json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, **kw}
                    ).encode()


# ------------------------------------------------------------------------------ deadlines

def test_slow_body_gets_408_within_the_deadline(server):
  with connect(server) as s:
    t0 = time.monotonic()
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"input")
    status, headers, obj = read_response(s)
    elapsed = time.monotonic() - t0
    assert status == 408, obj
    assert obj["error"]["type"] == "request_timeout"
    assert "not received within 1 s (7 of 100 bytes arrived)" in obj["error"]["message"]
    assert headers["connection"] == "close" and s.recv(1) == b""
  assert elapsed < DEADLINE_S + SLACK_S
  assert get(server, "/health")[0] == 200


def test_drip_fed_body_cannot_outlive_the_deadline(server):
  """A byte every DEADLINE_S/5 keeps every recv busy: only a total deadline stops it."""
  stop = threading.Event()
  with connect(server) as s:
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 10000\r\n\r\n")
    t0 = time.monotonic()
    t = threading.Thread(target=drip, args=(s, b"[" * 10000, DEADLINE_S / 5, stop))
    t.start()
    try:
      status, headers, obj = read_response(s)
      elapsed = time.monotonic() - t0
    finally:
      stop.set()
      t.join(10)
  assert status == 408 and "request body not received within" in obj["error"]["message"]
  assert headers["connection"] == "close"
  assert elapsed < DEADLINE_S + SLACK_S


def test_drip_fed_head_gets_408(server):
  stop = threading.Event()
  with connect(server) as s:
    t0 = time.monotonic()
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\n")
    t = threading.Thread(target=drip, args=(s, b"X-Slow: " + b"a" * 1000, DEADLINE_S / 5,
                                            stop))
    t.start()
    try:
      status, headers, obj = read_response(s)
      elapsed = time.monotonic() - t0
    finally:
      stop.set()
      t.join(10)
  assert status == 408 and "request head not received within" in obj["error"]["message"]
  assert headers["connection"] == "close"
  assert elapsed < DEADLINE_S + SLACK_S


def test_oversize_head_gets_431(server):
  with connect(server) as s:
    s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (128 << 10) + b"\r\n\r\n")
    status, headers, obj = read_response(s)
  assert status == 431 and "invalid HTTP request" in obj["error"]["message"]
  assert headers["connection"] == "close"


def test_silent_connection_is_closed(server):
  """A connection that never sends a byte is closed after keep_alive_s (2 * DEADLINE_S)."""
  with connect(server) as s:
    t0 = time.monotonic()
    assert s.recv(1) == b""
  assert time.monotonic() - t0 < 2 * DEADLINE_S + SLACK_S


# ------------------------------------------------------------------------------ parsing

def _nested(depth: int) -> bytes:
  return b"[" * depth + b"]" * depth


HOSTILE = [
    ("deep_array", _nested(100_000), "nested too deeply"),
    ("deep_object", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    ("deep_value_in_a_field", b'{"input_ids": [1], "sampling_params": {"stop_token_ids": '
     + _nested(800) + b"}}", "stop_token_ids"),
    ("5000_digit_token", b'{"input_ids": [' + b"7" * 5000 + b"]}", "4300 digits"),
    ("5000_digit_seed", b'{"input_ids": [1], "sampling_params": {"seed": ' + b"7" * 5000
     + b"}}", "4300 digits"),
    ("4000_digit_token", b'{"input_ids": [' + b"7" * 4000 + b"]}", "outside the vocabulary"),
    ("temperature_beyond_float", gen_body(sampling_params={"temperature": 10**400}),
     "temperature"),
    ("nan_temperature", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
     "temperature"),
    ("top_k_beyond_int32", gen_body(sampling_params={"top_k": 2**40}), "top_k"),
    ("stop_id_outside_vocab", gen_body(sampling_params={"stop_token_ids": [10**30]}),
     "stop_token_ids"),
    ("invalid_utf8_in_a_string", b'{"input_ids": [1], "rid": "\xff\xfe"}', "not UTF-8"),
    ("huge_unknown_key", json.dumps({"input_ids": [1], "k" * 100_000: 1}).encode(),
     "unsupported /generate fields"),
]


@pytest.mark.parametrize("name,body,needle", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_json_is_a_400_with_a_short_message(server, name, body, needle):
  status, _, obj = post(server, "/generate", body)
  assert status == 400, (name, obj)
  assert needle in obj["error"]["message"], obj
  assert len(obj["error"]["message"]) < 1000  # client values are quoted, not echoed whole
  assert get(server, "/health")[0] == 200


def test_lone_surrogate_rid_is_answered(server):
  status, _, out = post(server, "/generate", b'{"input_ids": [1], "rid": "\\ud800"}')
  assert status == 200 and out["meta_info"]["id"] == "\ud800"


_scalars = (st.none() | st.booleans() | st.integers(-3, 300) | st.integers()
            | st.integers(min_value=-2**100, max_value=2**100) | st.floats() | st.text(max_size=8))
_json_values = st.recursive(
    _scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                          max_size=4),
    max_leaves=12)
_huge = st.integers(2**31 - 2, 2**31 + 2) | st.integers(2**32 - 2, 2**32 + 2) | st.integers(
    2**40, 2**100)
# Per key: mostly plausible values (so bodies get past the other checks), plus edge values.
_per_key = {
    "max_new_tokens": st.integers(-2, 600) | _json_values,
    "temperature": st.floats(0, 2) | _huge | _json_values,
    "top_p": st.floats(0, 1) | _json_values,
    "top_k": st.integers(-2, 300) | _huge | _json_values,
    "stop_token_ids": st.lists(st.integers(0, 300) | _huge, max_size=9) | _json_values,
    "seed": st.integers(0, 2**32 + 2) | _json_values,
    "sampling_seed": st.integers(0, 2**32 + 2) | _json_values,
    "n": st.just(1) | _json_values, "ignore_eos": st.booleans() | _json_values,
    "bogus": _json_values}
_sampling = st.lists(st.sampled_from(sorted(_per_key)), max_size=3, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: _per_key[k] for k in keys}))
_prompt = st.lists(st.integers(0, 300), min_size=1, max_size=4)
_keys = st.sampled_from(["input_ids", "sampling_params", "return_logprob", "rid", "stream",
                         "logprob_start_len", "top_logprobs_num", "text", "zzz"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.fixed_dictionaries({"input_ids": _prompt | st.lists(_prompt, max_size=3),
                                   "sampling_params": _sampling | st.lists(_sampling,
                                                                            max_size=3)})
       | st.dictionaries(_keys, _json_values, max_size=5) | _json_values)
def test_any_json_body_is_a_request_or_a_400(body):
  """Validation turns every JSON value into an engine-safe request or a 400, nothing else."""
  try:
    req = parse_generate(body, vocab_size=VOCAB, max_positions=512, max_prompt_len=511)
  except ApiError as e:
    assert e.status == 400 and len(e.message) < 2000
    return
  for p, s in zip(req.prompts, req.sampling):  # what the engine's int32/uint32 arrays hold
    assert all(0 <= t < VOCAB for t in p) and len(p) + s.max_new_tokens <= 512
    assert all(0 <= t < VOCAB for t in s.stop_token_ids)
    assert s.top_k == -1 or 1 <= s.top_k < 2**31
    assert s.seed is None or 0 <= s.seed < 2**32
    assert math.isfinite(s.temperature) and s.temperature >= 0 and 0 < s.top_p <= 1


# ------------------------------------------------------------------------------ size limits

def _send_in_background(sock: socket.socket, data: bytes) -> threading.Thread:
  def send() -> None:
    try:
      sock.sendall(data)
    except OSError:  # the server closed after answering: expected once it stops draining
      pass
  t = threading.Thread(target=send)
  t.start()
  return t


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_oversize_body_gets_413_not_a_reset(server, chunked):
  """The whole 2 MiB body is sent: the 413 must still reach the client (no connection reset).

  With a Content-Length the server answers from the header; a chunked body is measured as it
  arrives. Either way it answers before reading everything and must not lose that answer.
  """
  body = b"[" + b"1," * LIMIT + b"1]"
  if chunked:
    head = b"POST /generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    step = 64 << 10
    payload = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step])
                       for i in range(0, len(body), step)) + b"0\r\n\r\n"
  else:
    head = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)
    payload = body
  with connect(server) as s:
    sender = _send_in_background(s, head + payload)
    try:
      status, headers, obj = read_response(s)
    finally:
      sender.join(30)
  assert status == 413, obj
  assert obj["error"]["type"] == "payload_too_large"
  assert f"exceeds the limit of {LIMIT} bytes" in obj["error"]["message"]
  assert headers["connection"] == "close"
  assert get(server, "/health")[0] == 200


def test_chunked_body_within_the_limit_is_accepted(server):
  body = gen_body()
  with connect(server) as s:
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
              + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    status, _, out = read_response(s)
  assert status == 200 and out["output_ids"] == [3, 4, 5]


def test_large_valid_body_is_answered(server):
  """A body over the inline-parse threshold (parsed on a worker thread) is served as usual."""
  prompts = [[(i + j) % 200 + 14 for j in range(100)] for i in range(300)]
  body = json.dumps({"input_ids": prompts, "sampling_params": {"max_new_tokens": 2}}).encode()
  assert len(body) > 64 << 10
  status, _, out = post(server, "/generate", body)
  assert status == 200 and len(out) == 300
  assert out[7]["output_ids"] == [sum(prompts[7]) % VOCAB, (sum(prompts[7]) + 1) % VOCAB]


# ------------------------------------------------------------------------------ auth

def test_auth_is_checked_before_routing(keyed, server):
  for path in ("/v2/nothing", "/generate", "/get_model_info"):
    status, obj = get(keyed, path)
    assert status == 401 and obj["error"]["type"] == "authentication_error", (path, obj)
  status, headers, obj = post(keyed, "/nothing", b'{"x": 1}')
  assert status == 401 and headers["connection"] == "close"  # the body was not read
  status, obj = get(keyed, "/v2/nothing", {"Authorization": "Bearer wrong"})
  assert status == 401 and obj["error"]["message"] == "invalid API key"
  status, obj = get(keyed, "/v2/nothing", {"Authorization": "Bearer k3y"})
  assert status == 404 and obj["error"]["message"] == "unknown path '/v2/nothing'"
  assert get(keyed, "/health")[0] == 200  # liveness probes need no key
  # And a 404 never lists the endpoints.
  status, obj = get(server, "/v2/nothing")
  assert status == 404 and "/generate" not in obj["error"]["message"]


def test_api_key_from_env_var_and_file(tmp_path, monkeypatch):
  key_file = tmp_path / "key"
  key_file.write_text("file-key\n")
  resolve = serve.resolve_api_key
  assert resolve(None, str(key_file), "cfg", {"TRACE_API_KEY": "env-key"}) == "file-key"
  assert resolve(None, None, "cfg", {"TRACE_API_KEY": "env-key"}) == "env-key"
  assert resolve("flag", None, "cfg", {"TRACE_API_KEY": "env-key"}) == "flag"
  assert resolve(None, None, "cfg", {}) == "cfg"
  assert resolve(None, None, None, {"TRACE_API_KEY": ""}) is None
  (tmp_path / "empty").write_text(" \n")
  with pytest.raises(ValueError, match="is empty"):
    resolve(None, str(tmp_path / "empty"), None, {})
  with pytest.raises(ValueError, match="cannot read the API key file"):
    resolve(None, str(tmp_path / "missing"), None, {})
  with pytest.raises(ValueError, match="not both"):
    resolve("flag", str(key_file), None, {})

  # Through the command-line flags, as `python -m rollout_bridge.serve` parses them.
  monkeypatch.setenv("TRACE_API_KEY", "env-key")
  try:
    for argv, want in ((["serve"], "env-key"),
                       (["serve", f"--api_key_file={key_file}"], "file-key")):
      serve.FLAGS.unparse_flags()
      serve.FLAGS(argv)
      cfg = serve._apply_flags(serve.load_config(None))
      assert cfg["server"]["api_key"] == want
  finally:
    serve.FLAGS.unparse_flags()
  with RolloutServer(StubEngine(), serve.server_options(cfg, "x")) as srv:
    assert get(srv, "/get_model_info")[0] == 401
    assert get(srv, "/get_model_info", {"Authorization": "Bearer file-key"})[0] == 200


def test_serve_cli_takes_the_key_from_the_environment():
  """The deployment path: the key never appears on the command line (visible in `ps`)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", TRACE_API_KEY="env-s3cret")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.Popen([sys.executable, "-m", "rollout_bridge.serve", f"--port={port}"],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  try:
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=180)
    with pytest.raises(RolloutHTTPError) as e:
      HttpRolloutEngine(url).model_info()
    assert e.value.status == 401
    assert HttpRolloutEngine(url, api_key="env-s3cret").model_info()["policy"] == "fp4_trace"
  finally:
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 0, out
  assert "API key required" in out and "env-s3cret" not in out


class _NaNEngine(StubEngine):
  """The stub engine whose log-probs are NaN, +Inf and -Inf (what NaN weights served)."""

  def generate(self, prompts, sampling):
    out = super().generate(prompts, sampling)
    for s in out:
      s.logprobs = [math.nan, math.inf, -math.inf][:len(s.logprobs)] + s.logprobs[3:]
    return out


def _strict_json(text: str) -> Any:
  def refuse(token: str) -> Any:
    raise AssertionError(f"bare {token} in a JSON response")
  return json.loads(text, parse_constant=refuse)


def test_responses_are_strict_json_even_for_non_finite_log_probs():
  """JSON has no NaN or Infinity: such a number is sent as null (plain and streamed)."""
  with RolloutServer(_NaNEngine(), ServerOptions(batch_window_s=0.002)).start() as srv:
    body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4},
                       "return_logprob": True}).encode()
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    out = _strict_json(conn.getresponse().read().decode())
    assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]][:3] == [None] * 3
    conn.request("POST", "/generate", json.dumps({**json.loads(body), "stream": True}).encode(),
                 {"Content-Type": "application/json"})
    events = _events(conn.getresponse().read())
    chunk = _strict_json(events[0])
    assert chunk["meta_info"]["output_token_logprobs"][0][0] is None and events[-1] == "[DONE]"
    conn.close()


# ------------------------------------------------------------------------------ streaming

def _events(data: bytes) -> list[str]:
  text = data.decode()
  assert text.endswith("\n\n"), text
  events = text[:-2].split("\n\n")
  assert all(e.startswith("data: ") for e in events), events
  return [e.removeprefix("data: ") for e in events]


def test_stream_is_sglang_server_sent_events(server):
  body = {"input_ids": [[1, 2], [3], [4, 5, 6]], "rid": ["a", "b", "c"],
          "sampling_params": [{"max_new_tokens": 3, "seed": 1}, {"max_new_tokens": 2},
                              {"max_new_tokens": 5, "stop_token_ids": [17]}],
          "return_logprob": True}
  status, _, want = post(server, "/generate", json.dumps(body).encode())
  assert status == 200
  status, headers, data = post(server, "/generate", json.dumps({**body, "stream": True}
                                                               ).encode())
  assert status == 200 and headers["content-type"].startswith("text/event-stream")
  events = _events(data)
  assert events[-1] == "[DONE]" and len(events) == 4
  chunks = [json.loads(e) for e in events[:-1]]
  assert sorted(c["index"] for c in chunks) == [0, 1, 2]
  for c in chunks:
    w = want[c["index"]]
    assert c["output_ids"] == w["output_ids"]
    for k in ("id", "finish_reason", "output_token_logprobs", "completion_tokens"):
      assert c["meta_info"][k] == w["meta_info"][k]
  assert chunks[2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 17}

  # One prompt: no index (as SGLang); the chunk is the whole answer.
  status, _, data = post(server, "/generate", gen_body(stream=True))
  (chunk, done) = _events(data)
  assert done == "[DONE]" and json.loads(chunk)["output_ids"] == [3, 4, 5]
  assert "index" not in json.loads(chunk)


def test_stream_errors(server):
  # Invalid input is refused before the stream starts: a plain 400.
  status, _, obj = post(server, "/generate", gen_body(stream=True, input_ids=[999]))
  assert status == 400 and "outside the vocabulary" in obj["error"]["message"]
  # An engine failure after the stream started is an error chunk, then [DONE] (as SGLang).
  status, _, data = post(server, "/generate", gen_body(stream=True, input_ids=[13]))
  assert status == 200
  err, done = _events(data)
  assert done == "[DONE]"
  err = json.loads(err)["error"]
  assert err["code"] == 500 and "stub engine exploded" in err["message"]


# ------------------------------------------------------------------------------ connections

def test_keep_alive_reuses_the_connection(server):
  conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
  try:
    conn.connect()
    sock = conn.sock
    for method, path, body, want in (
        ("GET", "/health", None, 200), ("POST", "/generate", gen_body(), 200),
        ("POST", "/generate", b'{"input_ids": [999]}', 400), ("GET", "/nothing", None, 404),
        ("POST", "/generate", gen_body(stream=True), 200), ("GET", "/trace/stats", None, 200)):
      conn.request(method, path, body=body)
      resp = conn.getresponse()
      resp.read()
      assert resp.status == want, (method, path)
      assert resp.getheader("connection") != "close"
      assert conn.sock is sock, f"the server closed the connection after {method} {path}"
    # A request whose body the server does not read ends the connection, said so up front.
    conn.request("POST", "/nothing", body=b'{"x": 1}')
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 404 and resp.getheader("connection") == "close"
  finally:
    conn.close()


class GateEngine(StubEngine):
  """StubEngine whose calls block until `gate` is set; `entered` says a call is running."""

  def __init__(self):
    super().__init__()
    self.gate = threading.Event()
    self.entered = threading.Event()

  def generate(self, prompts, sampling):
    self.entered.set()
    if not self.gate.wait(60):
      raise RuntimeError("the test never opened the gate")
    return super().generate(prompts, sampling)


def _call(srv: RolloutServer, prompt: list[int], results: dict[str, Any], name: str) -> None:
  try:
    results[name] = post(srv, "/generate", gen_body(input_ids=prompt))
  except Exception as e:  # reported by the asserts
    results[name] = e


def test_graceful_stop_finishes_running_work_and_fails_queued_work():
  eng = GateEngine()
  srv = RolloutServer(eng, ServerOptions(max_batch=1, batch_window_s=0.0,
                                         graceful_timeout_s=0.5)).start()
  results: dict[str, Any] = {}
  running = threading.Thread(target=_call, args=(srv, [1, 2], results, "running"))
  queued = threading.Thread(target=_call, args=(srv, [5], results, "queued"))
  stopper = threading.Thread(target=srv.stop)
  try:
    running.start()
    assert eng.entered.wait(30)
    queued.start()
    wait_until(lambda: srv.batcher.stats()["queued_prompts"] == 1)
    stopper.start()
    queued.join(30)  # answered once graceful_timeout_s has passed
    status, _, obj = results["queued"]
    assert status == 503 and "shutting down" in obj["error"]["message"]
    with pytest.raises(OSError):  # no new connections
      socket.create_connection((srv.host, srv.port), timeout=5).close()
    assert "running" not in results  # the running batch is not cut off...
    eng.gate.set()
    running.join(30)
    status, _, out = results["running"]
    assert status == 200 and out["output_ids"] == [3, 4, 5]  # ...it completes
    stopper.join(60)
    assert not stopper.is_alive()
  finally:
    eng.gate.set()
    srv.stop()


def test_disconnected_client_cancels_its_queued_prompts():
  eng = GateEngine()
  srv = RolloutServer(eng, ServerOptions(max_batch=1, batch_window_s=0.0)).start()
  results: dict[str, Any] = {}
  running = threading.Thread(target=_call, args=(srv, [1, 2], results, "running"))
  try:
    running.start()
    assert eng.entered.wait(30)
    with connect(srv) as s:
      body = gen_body(input_ids=[[1], [2], [3]])
      s.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body))
      wait_until(lambda: srv.batcher.stats()["queued_prompts"] == 3)
    wait_until(lambda: srv.batcher.stats()["cancelled_prompts"] == 3)
    assert srv.batcher.stats()["queued_prompts"] == 0
    eng.gate.set()
    running.join(30)
    assert results["running"][0] == 200
    assert srv.batcher.stats()["engine_calls"] == 1  # the abandoned prompts never ran
  finally:
    eng.gate.set()
    srv.stop()

