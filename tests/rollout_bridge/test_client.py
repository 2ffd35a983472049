"""The HTTP rollout client against our server (stub engine: no compile) and an SGLang double.

The SGLang double answers with SGLang 0.5.x's native shapes (`text`, `output_ids`,
`meta_info.finish_reason.matched`, `output_token_logprobs` triples, `{"success", "message"}`
weight updates, a plain-text `/flush_cache`, an empty `/health`), and records what the client
sent, so the client is checked against both servers it has to drive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rollout_bridge.client import (
  HttpRolloutEngine,
  RolloutHTTPError,
  RolloutProtocolError,
  wait_healthy,
)
from rollout_bridge.server import RolloutServer, ServerOptions
from trace_jax.guidance.handle import GuidanceHandle
from trace_jax.model.config import tiny
from trace_jax.rollout.protocol import RolloutEngine, Sample, SamplingParams

REPO = Path(__file__).resolve().parents[2]


class StubEngine:
  """Deterministic fake engine: token i of a prompt's answer is (sum(prompt) + seed + i) % V."""

  def __init__(self):
    self.config = tiny(policy="fp4_trace")
    self.weights_version = 0
    self.paths: list[str] = []
    self.record = True

  def generate(self, prompts, sampling):
    out = []
    for p, s in zip(prompts, sampling):
      if 13 in p:
        raise RuntimeError("stub engine exploded")
      toks = [(sum(p) + (s.seed or 0) + i) % self.config.vocab_size
              for i in range(s.max_new_tokens)]
      stop = next((i for i, t in enumerate(toks) if t in s.stop_token_ids), None)
      toks = toks if stop is None else toks[:stop + 1]
      out.append(Sample(list(p), toks, [-0.25 * (i + 1) for i in range(len(toks))],
                        "length" if stop is None else "stop",
                        guidance=GuidanceHandle(store="/g", batch_id="b000001",
                                                seq_id="b000001-0"),
                        meta={"weights_version": self.weights_version}))
    return out

  def update_weights(self, path):
    if "bad" in str(path):
      raise FileNotFoundError(f"no safetensors in {path}")
    self.paths.append(str(path))
    self.weights_version += 1

  def close(self):
    pass


@pytest.fixture(scope="module")
def ours():
  eng = StubEngine()
  srv = RolloutServer(eng, ServerOptions(batch_window_s=0.005)).start()
  yield srv
  srv.stop()


# ------------------------------------------------------------------------------ SGLang double

class _SGLangHandler(BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  seen: list[dict[str, Any]] = []
  mode: dict[str, Any] = {}

  def log_message(self, *args: Any) -> None:
    pass

  def _reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
    self.send_response(status)
    self.send_header("Content-Type", ctype)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def do_GET(self) -> None:
    self.seen.append({"method": "GET", "path": self.path, "headers": dict(self.headers)})
    if self.path == "/health":
      self._reply(200, b"")
    elif self.path == "/get_model_info":
      self._reply(200, json.dumps({"model_path": "Qwen/Qwen3-30B-A3B", "is_generation": True,
                                   "weight_version": "default"}).encode())
    else:
      self._reply(404, json.dumps({"detail": "Not Found"}).encode())

  def do_POST(self) -> None:
    n = int(self.headers.get("Content-Length", 0))
    body = json.loads(self.rfile.read(n) or b"null")
    self.seen.append({"method": "POST", "path": self.path, "body": body,
                      "headers": dict(self.headers)})
    mode = self.mode.get(self.path)
    if self.path == "/generate":
      if mode == "slow":
        time.sleep(1.5)
      if mode == "422":
        self._reply(422, json.dumps({"detail": "input_ids: field required"}).encode())
        return
      outs = []
      for i, p in enumerate(body["input_ids"]):
        ids = [7, 8, 2]
        lps = [[-0.5, 7, None], [-1.5, 8, None], [-0.1, 2, None]]
        if mode == "mismatch":
          lps = lps[:2]
        finish = {"type": "stop", "matched": 2}
        if mode == "abort":
          finish = {"type": "abort", "message": "weights updated"}
        outs.append({"text": "", "output_ids": ids, "meta_info": {
            "id": f"r{i}", "prompt_tokens": len(p), "completion_tokens": 3, "cached_tokens": 0,
            "finish_reason": finish, "output_token_logprobs": lps, "weight_version": "default",
            "e2e_latency": 0.01}})
      self._reply(200, json.dumps(outs).encode())
    elif self.path == "/update_weights_from_disk":
      ok = mode != "fail"
      self._reply(200 if ok else 400, json.dumps({
          "success": ok, "message": "Succeeded to update model weights." if ok else
          "Failed to update weights: boom. Rolling back to the original path.",
          "num_paused_requests": 0}).encode())
    elif self.path == "/flush_cache":
      self._reply(200, b"Cache flushed.\nPlease check backend logs for more details.\n",
                  "text/plain")
    else:
      self._reply(404, json.dumps({"detail": "Not Found"}).encode())


@pytest.fixture()
def sglang():
  _SGLangHandler.seen = []
  _SGLangHandler.mode = {}
  httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SGLangHandler)
  httpd.daemon_threads = True
  t = threading.Thread(target=httpd.serve_forever, daemon=True)
  t.start()
  yield httpd, _SGLangHandler
  httpd.shutdown()
  httpd.server_close()


def _url(httpd: ThreadingHTTPServer) -> str:
  return f"http://127.0.0.1:{httpd.server_address[1]}"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# ------------------------------------------------------------------------------ our server

def test_generate_roundtrip(ours):
  client = HttpRolloutEngine(ours.url)
  assert isinstance(client, RolloutEngine)
  prompts = [[1, 2, 3], [4], [5, 6]]
  sampling = [SamplingParams(max_new_tokens=4, seed=3), SamplingParams(max_new_tokens=2),
              SamplingParams(max_new_tokens=6, stop_token_ids=(13,), seed=0)]
  samples = client.generate(prompts, sampling)
  want = StubEngine().generate(prompts, sampling)
  assert [s.prompt for s in samples] == prompts
  assert [s.tokens for s in samples] == [w.tokens for w in want]
  assert [s.logprobs for s in samples] == [w.logprobs for w in want]
  assert [s.finish_reason for s in samples] == ["length", "length", "stop"]
  assert samples[0].guidance.batch_id == "b000001"
  assert samples[0].meta["weight_version"] == "0" and samples[0].meta["prompt_tokens"] == 3
  assert client.generate([], SamplingParams()) == []
  assert client.health() and client.model_info()["is_generation"]
  client.flush_cache()
  assert client.guidance_info()["enabled"]
  assert client.stats()["batcher"]["prompts"] >= 3


def test_server_errors_carry_the_server_message(ours):
  client = HttpRolloutEngine(ours.url)
  with pytest.raises(RolloutHTTPError) as e:
    client.generate([[1, 999]], SamplingParams())
  assert e.value.status == 400 and e.value.kind == "invalid_request_error"
  assert "outside the vocabulary" in e.value.message and "/generate" in str(e.value)
  with pytest.raises(RolloutHTTPError) as e:  # the engine itself fails: 500 with its message
    client.generate([[13]], SamplingParams(max_new_tokens=2))
  assert e.value.status == 500 and "stub engine exploded" in e.value.message
  with pytest.raises(ValueError, match="2 prompts but 1"):
    client.generate([[1], [2]], [SamplingParams()])
  assert client.health()


def test_update_weights(ours, tmp_path):
  client = HttpRolloutEngine(ours.url)
  client.update_weights(tmp_path, weight_version="v7")
  assert ours.engine.paths[-1] == str(tmp_path)
  (s,) = client.generate([[1]], SamplingParams(max_new_tokens=1))
  assert s.meta["weight_version"] == "v7"
  with pytest.raises(RolloutHTTPError) as e:
    client.update_weights(tmp_path / "bad")
  assert e.value.status == 400 and "no safetensors" in e.value.message
  with pytest.raises(TypeError, match="save_hf_checkpoint"):
    client.update_weights({"w": 1})


# ------------------------------------------------------------------------------ SGLang double

def test_drives_sglang_shaped_server(sglang):
  httpd, h = sglang
  client = HttpRolloutEngine(_url(httpd), api_key="k1")
  samples = client.generate([[1, 2], [3]], [SamplingParams(max_new_tokens=3, seed=5),
                                            SamplingParams(max_new_tokens=3, temperature=0.0)])
  assert [s.tokens for s in samples] == [[7, 8, 2]] * 2
  assert samples[0].logprobs == [-0.5, -1.5, -0.1] and samples[0].finish_reason == "stop"
  assert samples[0].guidance is None and samples[0].meta["weight_version"] == "default"
  req = h.seen[-1]
  assert req["path"] == "/generate" and req["headers"]["Authorization"] == "Bearer k1"
  assert req["body"]["input_ids"] == [[1, 2], [3]] and req["body"]["return_logprob"] is True
  assert req["body"]["sampling_params"][0]["sampling_seed"] == 5
  assert req["body"]["sampling_params"][1]["temperature"] == 0.0

  client.update_weights("/ckpt/step-3")
  assert h.seen[-1]["body"] == {"model_path": "/ckpt/step-3"}
  client.flush_cache()  # plain-text answer
  assert client.health()  # empty answer
  assert client.model_info()["model_path"] == "Qwen/Qwen3-30B-A3B"
  with pytest.raises(RolloutHTTPError) as e:
    client.guidance_info()  # SGLang has no guidance extension
  assert e.value.status == 404 and e.value.message == "Not Found"

  h.mode["/update_weights_from_disk"] = "fail"
  with pytest.raises(RolloutHTTPError, match="boom"):
    client.update_weights("/ckpt/step-4")
  h.mode["/generate"] = "422"
  with pytest.raises(RolloutHTTPError, match="field required"):
    client.generate([[1]], SamplingParams())
  h.mode["/generate"] = "abort"
  with pytest.raises(RolloutProtocolError, match="aborted"):
    client.generate([[1]], SamplingParams())
  h.mode["/generate"] = "mismatch"
  with pytest.raises(RolloutProtocolError, match="do not match"):
    client.generate([[1]], SamplingParams())
  h.mode["/generate"] = "slow"
  with pytest.raises(TimeoutError):
    HttpRolloutEngine(_url(httpd), timeout=0.3).generate([[1]], SamplingParams())


# ------------------------------------------------------------------------------ connections

def test_retries_then_gives_up():
  port = _free_port()  # nothing listens there
  client = HttpRolloutEngine(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.05)
  t0 = time.monotonic()
  with pytest.raises(ConnectionError, match="3 attempts"):
    client.generate([[1]], SamplingParams())
  assert time.monotonic() - t0 < 5
  assert not client.health()
  with pytest.raises(TimeoutError, match="not healthy"):
    wait_healthy(f"http://127.0.0.1:{port}", timeout=0.5)


def test_retries_reach_a_late_server():
  port = _free_port()
  box: dict[str, Any] = {}

  def late_start() -> None:
    time.sleep(0.4)
    box["srv"] = RolloutServer(StubEngine(), ServerOptions(batch_window_s=0.0),
                               port=port).start()

  t = threading.Thread(target=late_start)
  t.start()
  try:
    client = HttpRolloutEngine(f"127.0.0.1:{port}", retries=6, backoff_s=0.1)
    (s,) = client.generate([[2, 2]], SamplingParams(max_new_tokens=2, seed=1))
    assert s.tokens == [5, 6]
    wait_healthy(client.base_url, timeout=5)
  finally:
    t.join()
    if "srv" in box:
      box["srv"].stop()


# ------------------------------------------------------------------------------ CLI

def test_serve_cli_defaults_to_tiny_fp4_trace(tmp_path):
  """`python -m rollout_bridge.serve --port=P` serves the tiny model; SIGTERM stops it."""
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.Popen([sys.executable, "-m", "rollout_bridge.serve", f"--port={port}"],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  try:
    wait_healthy(f"http://127.0.0.1:{port}", timeout=180)
    client = HttpRolloutEngine(f"http://127.0.0.1:{port}")
    info = client.model_info()
    assert info["model_path"] == "random-init:tiny(seed=0)" and info["policy"] == "fp4_trace"
    assert info["config"]["vocab_size"] == 256
    with pytest.raises(RolloutHTTPError):
      client.generate([[300]], SamplingParams())
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  assert proc.returncode == 0, out
  assert re.search(rf"serving .* on http://127\.0\.0\.1:{port}", out), out
