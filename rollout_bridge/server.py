"""The rollout engine behind the subset of SGLang's native HTTP API that RL needs.

Endpoints (SGLang names and shapes, so one client drives this server and a real SGLang server):
  POST /generate                  input_ids (one prompt or a batch), sampling_params,
                                  return_logprob, rid, stream -> SGLang's {output_ids, meta_info}
                                  (a list for a batch); meta_info.trace_guidance says where the
                                  request's guidance was written (our extension). stream=true
                                  answers server-sent events as SGLang does: `data: {chunk}` per
                                  prompt (a batch's chunks carry `index`), then `data: [DONE]`
  POST /update_weights_from_disk  {"model_path": HF safetensors dir} -> {"success", "message"}
  GET|POST /flush_cache           no cross-request cache here: always succeeds
  GET /health, GET /get_model_info
  GET /trace/guidance             guidance extension: store root, mode, layers, sites, last batch
  GET /trace/stats                batching and HTTP counters

Every malformed request gets a 4xx `{"error": {"message", "type"}}` saying what is wrong, and
is rejected before it reaches the batcher, so a bad request never fails anyone else's batch.
Client input never causes a 500: JSON that is nested too deeply, integers too long to parse and
invalid UTF-8 are 400s, a body over `max_body_bytes` is a 413, a body (or request head) that
does not arrive within its deadline is a 408, and the API key is checked before routing, so an
unauthenticated client learns nothing about the endpoints. docs/reliability.md lists the
promises and the measured load figures.

Three modules: `rollout_bridge.api` parses requests and shapes answers (no HTTP),
`rollout_bridge.server` (this one) is the application (`RolloutServer`: the endpoints, weights,
counters, lifecycle) and `rollout_bridge.transport` the HTTP layer: uvicorn (h11 protocol,
asyncio) with starlette responses, SGLang's own serving stack. One event loop thread does all
HTTP work; `/generate` requests wait for the batcher (which runs the engine on its own thread)
without holding a thread each, so thousands of concurrent requests cost sockets, not threads.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import socket
import threading
import time
from http import HTTPStatus
from typing import Any

from rollout_bridge import transport
from rollout_bridge.api import (
  DEFAULT_MAX_STOP_IDS,
  UPDATE_KEYS,
  ApiError,
  GenerateRequest,
  bad_request,
  parse_generate,
  sglang_output,
  show,
)
from rollout_bridge.batcher import Batcher, BatcherClosed, Job
from trace_jax.model.config import SITES
from trace_jax.rollout.protocol import Sample

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """Server settings that are not the model's.

  max_batch / batch_window_s / pad_batch_to: see `Batcher` (pad_batch_to: fixed engine batch
  rows, so only one batch shape is ever compiled). max_prompt_len: longest accepted prompt
  (None: max_position_embeddings - 1). max_new_tokens_limit: None means up to the model's
  max_position_embeddings. api_key: required as `Authorization: Bearer <key>` on every path
  except /health. model_path: reported by /get_model_info.

  Transport limits (docs/reliability.md): max_body_bytes (413 above it), max_header_bytes
  (request line + headers; 431 above it), header_timeout_s (a request's head must be complete
  this long after its first byte, else 408 and close), body_timeout_s (the whole body must
  arrive this long after the head, else 408 and close), keep_alive_s (an idle connection,
  fresh or between requests, is closed after this long), request_timeout_s (a generation
  waits this long for the engine, else 504), graceful_timeout_s (`stop()` lets in-flight
  requests finish this long before failing queued ones with 503), backlog (listen queue; the
  kernel caps it at net.core.somaxconn).
  """
  max_batch: int = 32
  batch_window_s: float = 0.01
  pad_batch_to: int | None = None
  max_body_bytes: int = 16 << 20
  max_header_bytes: int = 64 << 10
  max_prompts_per_request: int = 1024
  max_prompt_len: int | None = None
  max_new_tokens_limit: int | None = None
  request_timeout_s: float = 600.0
  header_timeout_s: float = 10.0
  body_timeout_s: float = 30.0
  keep_alive_s: float = 30.0
  graceful_timeout_s: float = 30.0
  backlog: int = 4096
  api_key: str | None = None
  model_path: str = "random-init"
  weight_version: str = "0"
  extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)



# ------------------------------------------------------------------------------- the app

class RolloutServer:
  """The HTTP server around one engine (an `InProcessEngine`, or anything with its surface).

  The engine needs `config` (a ModelConfig), `generate`, `update_weights` and `close`;
  `weights_version`, `store` (a GuidanceStore) and `record` are used when present.
  The constructor binds and listens (so `url` is known at once; connections made before
  `start()` wait in the backlog). `start()` serves on a background thread and returns;
  `serve_forever()` blocks until `shutdown()`/`stop()`; `stop()` is graceful.
  """

  def __init__(self, engine: Any, options: ServerOptions | None = None,
               host: str = "127.0.0.1", port: int = 0):
    self.engine = engine
    self.options = options or ServerOptions()
    cfg = engine.config
    self.vocab_size = int(cfg.vocab_size)
    self.max_positions = int(cfg.max_position_embeddings)
    self.max_prompt_len = self.options.max_prompt_len or self.max_positions - 1
    from trace_jax.rollout import engine as engine_mod  # the engine's stop-id capacity
    self.max_stop_ids = int(getattr(engine_mod, "_MAX_STOP_IDS", DEFAULT_MAX_STOP_IDS))
    self.batcher = Batcher(engine, max_batch=self.options.max_batch,
                           window_s=self.options.batch_window_s, pad_to=self.options.pad_batch_to)
    self._update_lock = threading.Lock()
    self.model_path = self.options.model_path
    self._labels: dict[int, str] = {self._engine_version(): self.options.weight_version}
    self._started = time.time()
    self._counts: dict[str, int] = {"requests": 0, "errors_4xx": 0, "errors_5xx": 0}
    self._counts_lock = threading.Lock()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self._sock = socket.create_server((host, port), family=family,
                                      backlog=self.options.backlog)
    self._address = self._sock.getsockname()[:2]
    self._uv: transport.UvicornServer | None = None
    self._thread: threading.Thread | None = None
    self._stop_lock = threading.Lock()
    self._stopped = False
    self._closed = threading.Event()

  # ---------------------------------------------------------------------------- lifecycle

  @property
  def host(self) -> str:
    return self._address[0]

  @property
  def port(self) -> int:
    return self._address[1]

  @property
  def url(self) -> str:
    host = f"[{self.host}]" if ":" in self.host else self.host
    return f"http://{host}:{self.port}"

  def start(self) -> RolloutServer:
    """Serves on a daemon thread; returns once the server accepts connections."""
    if self._stopped:
      raise RuntimeError("this RolloutServer was stopped; make a new one")
    if self._thread is not None:
      return self
    self.batcher.start()
    self._uv = transport.make_uvicorn(self)
    self._thread = threading.Thread(target=self._run, name="rollout-http", daemon=True)
    self._thread.start()
    self._uv.ready.wait()
    if not self._uv.started:
      raise RuntimeError(f"the HTTP server failed to start: {self._uv.error!r}")
    return self

  def _run(self) -> None:
    assert self._uv is not None
    try:
      self._uv.run(sockets=[self._sock])
    except BaseException as e:  # SystemExit from uvicorn's start-up failure included
      self._uv.error = e
      log.exception("the HTTP server thread failed")
    finally:
      self._uv.ready.set()

  def serve_forever(self) -> None:
    """Serves until `shutdown()` or `stop()` is called (e.g. by a signal handler)."""
    self.start()
    self._closed.wait()

  def shutdown(self) -> None:
    """Asks for a graceful `stop()` from any thread or a signal handler; returns at once."""
    threading.Thread(target=self.stop, name="rollout-stop", daemon=True).start()

  def stop(self, close_engine: bool = False) -> None:
    """Graceful stop: no new connections, in-flight requests finish, then the rest fail.

    Closes the listening socket and idle connections at once; requests being answered get up
    to `graceful_timeout_s` to finish; then the batcher stops, so jobs still queued are
    answered 503, and the batch the engine is running completes. Idempotent.
    """
    with self._stop_lock:
      if not self._stopped:
        self._stopped = True
        uv, thread = self._uv, self._thread
        if thread is not None and uv is not None:
          uv.should_exit = True
          thread.join(self.options.graceful_timeout_s)
        self.batcher.stop()
        if thread is not None:
          thread.join(90.0)
          if thread.is_alive():
            log.warning("the HTTP server thread did not finish")
        self._sock.close()
        self._closed.set()
    if close_engine:
      self.engine.close()

  def __enter__(self) -> RolloutServer:
    return self.start()

  def __exit__(self, *exc: Any) -> None:
    self.stop()

  # ---------------------------------------------------------------------------- helpers

  def _engine_version(self) -> int:
    return int(getattr(self.engine, "weights_version", 0))

  def weight_version(self, version: int | None = None) -> str:
    v = self._engine_version() if version is None else version
    return self._labels.get(v, str(v))

  def count(self, key: str) -> None:
    with self._counts_lock:
      self._counts[key] = self._counts.get(key, 0) + 1

  def check_auth(self, path: str, header: str | None) -> None:
    key = self.options.api_key
    if not key or path == "/health":
      return
    if header is None:
      raise ApiError(HTTPStatus.UNAUTHORIZED, "missing API key: send `Authorization: Bearer "
                     "<key>`", "authentication_error", {"WWW-Authenticate": "Bearer"})
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
      raise ApiError(HTTPStatus.UNAUTHORIZED, "invalid API key", "authentication_error",
                     {"WWW-Authenticate": "Bearer"})

  # ---------------------------------------------------------------------------- endpoints

  def parse_generate_body(self, body: Any) -> GenerateRequest:
    """`parse_generate` with this server's model and limits."""
    return parse_generate(body, vocab_size=self.vocab_size, max_positions=self.max_positions,
                          max_prompt_len=self.max_prompt_len,
                          max_new_limit=self.options.max_new_tokens_limit,
                          max_prompts=self.options.max_prompts_per_request,
                          max_stop_ids=self.max_stop_ids)

  def submit(self, req: GenerateRequest) -> Job:
    """Queues a validated request on the batcher (503 once the server is stopping)."""
    try:
      return self.batcher.submit(req.prompts, req.sampling)
    except BatcherClosed as e:
      raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(e), "unavailable") from e

  def job_samples(self, job: Job, timeout: float | None = 0.0) -> list[Sample]:
    """A finished job's samples, its failure as an ApiError (what the client is told)."""
    try:
      return job.wait(timeout)
    except BatcherClosed as e:
      raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(e), "unavailable") from e
    except TimeoutError as e:
      raise ApiError(HTTPStatus.GATEWAY_TIMEOUT, str(e), "timeout") from e
    except ValueError as e:  # the engine refused something our validation let through
      raise bad_request(f"generation rejected: {e}") from e
    except Exception as e:
      log.error("generation failed: %s: %s", type(e).__name__, e)
      raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                     f"generation failed: {type(e).__name__}: {e}", "server_error") from e

  def outputs(self, req: GenerateRequest, samples: list[Sample], t0: float
              ) -> list[dict[str, Any]]:
    """One SGLang answer per prompt."""
    dt = time.perf_counter() - t0
    return [sglang_output(s, rid, rl, self.weight_version(s.meta.get("weights_version")), dt)
            for s, rid, rl in zip(samples, req.rids, req.return_logprob)]

  def generate(self, body: Any) -> Any:
    """A blocking /generate (no HTTP): the answer object, or raises ApiError."""
    t0 = time.perf_counter()
    req = self.parse_generate_body(body)
    job = self.submit(req)
    out = self.outputs(req, self.job_samples(job, self.options.request_timeout_s), t0)
    return out if req.is_batch else out[0]

  def update_weights_from_disk(self, body: Any) -> tuple[int, dict[str, Any]]:
    if not isinstance(body, dict):
      raise bad_request("the request body must be a JSON object with `model_path`")
    unknown = sorted(k for k in set(body) - UPDATE_KEYS if body[k] is not None)
    if unknown:
      raise bad_request(f"unsupported /update_weights_from_disk fields {show(unknown)}; supported: "
                 f"{sorted(UPDATE_KEYS)}")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
      raise bad_request("missing `model_path`: the directory of an HF safetensors checkpoint")
    if body.get("load_format") not in (None, "auto", "safetensors"):
      raise bad_request(f"load_format {show(body['load_format'])} is not supported "
                 "(auto/safetensors)")
    label = body.get("weight_version")
    if label is not None and not isinstance(label, str):
      raise bad_request(f"`weight_version` must be a string, got {show(label)}")
    with self._update_lock:
      nxt = self._engine_version() + 1
      if label is not None:
        self._labels[nxt] = label
      t0 = time.perf_counter()
      try:
        # Waits for the running batch (the engine's lock); queued requests get the new weights.
        self.engine.update_weights(path)
      except Exception as e:
        self._labels.pop(nxt, None)
        log.warning("update_weights_from_disk(%s) failed: %s", path, e)
        msg = f"failed to load weights from {path}: {type(e).__name__}: {e}"
        return HTTPStatus.BAD_REQUEST, {
            "success": False, "message": msg,
            "error": {"message": msg, "type": "invalid_request_error"}}
      dt = time.perf_counter() - t0
      self.model_path = path  # as SGLang: /get_model_info names the weights being served
    log.info("weights updated from %s in %.2f s (version %s)", path, dt, self.weight_version())
    return HTTPStatus.OK, {"success": True, "num_paused_requests": 0,
                           "message": f"Succeeded to update model weights from {path} in "
                                      f"{dt:.2f} s; weight_version {self.weight_version()}",
                           "weight_version": self.weight_version()}

  def health(self) -> dict[str, Any]:
    return {"status": "ok", "uptime_s": time.time() - self._started}

  def model_info(self) -> dict[str, Any]:
    cfg = self.engine.config
    info = {
        "model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
        "weight_version": self.weight_version(), "policy": cfg.policy,
        "logprobs": "log_softmax of the unscaled logits (temperature 1), before top-k/top-p",
        "max_batch": self.options.max_batch, "max_prompt_len": self.max_prompt_len,
        "config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg),
    }
    info.update(self.options.extra_info)
    return info

  def guidance_info(self) -> dict[str, Any]:
    cfg = self.engine.config
    store = getattr(self.engine, "store", None)
    record = bool(getattr(self.engine, "record", cfg.forward.guided))
    last = self.batcher.stats()["last_batch"]
    return {
        "enabled": record, "policy": cfg.policy,
        "store": getattr(store, "root", None),
        "config_hash": getattr(store, "config_hash", None),
        "mode": cfg.guidance_mode, "guided_layers": list(cfg.guided_layers) if record else [],
        "sites": list(SITES) if record else [], "routing": record,
        "last_batch": None if last is None else {
            k: last[k] for k in ("guidance_batch_id", "guidance_store",
                                 "guidance_bytes_per_token", "prompts", "rows",
                                 "generated_tokens")},
    }

  def stats(self) -> dict[str, Any]:
    with self._counts_lock:
      counts = dict(self._counts)
    uv = self._uv
    counts["open_connections"] = len(uv.server_state.connections) if uv is not None else 0
    return {"http": counts, "batcher": self.batcher.stats(),
            "weight_version": self.weight_version()}


