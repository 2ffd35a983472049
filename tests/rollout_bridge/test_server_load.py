"""Load test of the rollout HTTP server on loopback: 256 concurrent clients, 1,024 requests.

The engine is a small deterministic stub implementing the RolloutEngine protocol
(`StubEngine` of test_client.py: token i of an answer is (sum(prompt) + seed + i) % vocab), not
the JAX model: on 2 shared CPU cores the model would make this a test of the engine, and the
HTTP stack (uvicorn/h11, the app, the batcher) is what is under load here. Half the clients
open a new connection per request (`HttpRolloutEngine` with retries off, so a reset or refused
connection counts as a failure instead of being retried); the other half send all their
requests over one kept-alive connection and check the server kept it. Every answer is checked
token for token. Bounded: every HTTP call times out after 60 s, the run must finish within
RUN_LIMIT_S, and the server is stopped in a finally. docs/reliability.md records the figures.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

from test_client import StubEngine  # pytest (prepend mode) puts this directory on sys.path

from rollout_bridge.client import HttpRolloutEngine
from rollout_bridge.server import RolloutServer, ServerOptions
from trace_jax.rollout.protocol import SamplingParams

CLIENTS = 256
REQUESTS_PER_CLIENT = 4
RUN_LIMIT_S = 120.0
HTTP_TIMEOUT_S = 60.0


def _prompt(client: int, k: int) -> list[int]:
  return [(31 * client + 7 * k + j) % 200 + 14 for j in range(1 + (client + k) % 6)]  # no 13


def _sampling(client: int, k: int) -> SamplingParams:
  return SamplingParams(max_new_tokens=1 + (client * 3 + k) % 8, seed=client * 10 + k)


def _expected(prompt: list[int], sp: SamplingParams, vocab: int) -> list[int]:
  return [(sum(prompt) + sp.seed + i) % vocab for i in range(sp.max_new_tokens)]


def _fresh_connections(url: str, client: int, vocab: int) -> list[str]:
  """REQUESTS_PER_CLIENT requests, each on a new connection; returns the failures."""
  engine = HttpRolloutEngine(url, timeout=HTTP_TIMEOUT_S, retries=0)
  failures = []
  for k in range(REQUESTS_PER_CLIENT):
    p, sp = _prompt(client, k), _sampling(client, k)
    try:
      (s,) = engine.generate([p], sp)
      if s.tokens != _expected(p, sp, vocab) or s.prompt != p:
        failures.append(f"client {client} request {k}: wrong answer {s.tokens}")
    except Exception as e:
      failures.append(f"client {client} request {k}: {type(e).__name__}: {e}")
  return failures


def _kept_alive(host: str, port: int, client: int, vocab: int) -> list[str]:
  """REQUESTS_PER_CLIENT requests over one connection, which must stay open throughout."""
  conn = http.client.HTTPConnection(host, port, timeout=HTTP_TIMEOUT_S)
  failures = []
  try:
    conn.connect()
    sock = conn.sock
    for k in range(REQUESTS_PER_CLIENT):
      p, sp = _prompt(client, k), _sampling(client, k)
      body = {"input_ids": p, "sampling_params": sp.to_sglang(), "return_logprob": True}
      try:
        conn.request("POST", "/generate", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
        if resp.status != 200 or out["output_ids"] != _expected(p, sp, vocab):
          failures.append(f"client {client} request {k}: HTTP {resp.status}: {out}")
        elif conn.sock is not sock:
          failures.append(f"client {client} request {k}: the keep-alive connection was closed")
      except Exception as e:
        failures.append(f"client {client} request {k}: {type(e).__name__}: {e}")
  finally:
    conn.close()
  return failures


def test_256_concurrent_clients_1024_requests_zero_failures():
  engine = StubEngine()
  vocab = engine.config.vocab_size
  srv = RolloutServer(engine, ServerOptions(max_batch=64, batch_window_s=0.005)).start()
  results: list[list[str] | None] = [None] * CLIENTS
  barrier = threading.Barrier(CLIENTS + 1)

  def client(i: int) -> None:
    try:
      barrier.wait(60)
      results[i] = (_fresh_connections(srv.url, i, vocab) if i % 2 == 0
                    else _kept_alive(srv.host, srv.port, i, vocab))
    except BaseException as e:  # reported below
      results[i] = [f"client {i}: {type(e).__name__}: {e}"]

  threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
  try:
    for t in threads:
      t.start()
    barrier.wait(60)  # all clients start together
    t0 = time.monotonic()
    deadline = t0 + RUN_LIMIT_S
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
    wall = time.monotonic() - t0
    stats = srv.stats()
  finally:
    srv.stop()
  assert not any(t.is_alive() for t in threads), f"clients still running after {RUN_LIMIT_S} s"
  failures: list[Any] = [f for r in results for f in (r if r is not None else ["no result"])]
  requests = CLIENTS * REQUESTS_PER_CLIENT
  print(f"\nload: {CLIENTS} clients, {requests} requests, {len(failures)} failures, "
        f"{wall:.1f} s ({requests / wall:.0f} req/s), {stats['batcher']['engine_calls']} "
        f"engine calls, largest batch {stats['batcher']['max_batch_seen']}")
  assert not failures, f"{len(failures)} failures, e.g. {failures[:5]}"
  assert stats["batcher"]["prompts"] == requests
  assert stats["http"]["errors_4xx"] == stats["http"]["errors_5xx"] == 0
  assert stats["batcher"]["engine_calls"] < requests  # concurrent requests were batched
