"""The rollout engine behind the subset of SGLang's native HTTP API that RL needs.

Endpoints (SGLang names and shapes, so one client drives this server and a real SGLang server):
  POST /generate                  input_ids (one prompt or a batch), sampling_params,
                                  return_logprob, rid -> SGLang's {output_ids, meta_info}
                                  (a list for a batch); meta_info.trace_guidance says where the
                                  request's guidance was written (our extension)
  POST /update_weights_from_disk  {"model_path": HF safetensors dir} -> {"success", "message"}
  GET|POST /flush_cache           no cross-request cache here: always succeeds
  GET /health, GET /get_model_info
  GET /trace/guidance             guidance extension: store root, mode, layers, sites, last batch
  GET /trace/stats                batching counters (engine calls, batch sizes, ...)

Every malformed request gets a 4xx `{"error": {"message", "type"}}` saying what is wrong, and
is rejected before it reaches the batcher, so a bad request never fails anyone else's batch.
Standard library only (`http.server.ThreadingHTTPServer`): one thread per connection, the
handler threads block on the batcher, which runs the engine on its own thread.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from rollout_bridge.batcher import Batcher, BatcherClosed
from trace_jax.rollout.protocol import Sample, SamplingParams

log = logging.getLogger(__name__)

GUIDANCE_SITES = ("moe_in", "expert_mid", "k", "v")
SEED_LIMIT = 2**32  # the engine builds PRNG keys from uint32 seeds
DEFAULT_MAX_STOP_IDS = 8  # trace_jax.rollout.engine._MAX_STOP_IDS

# Top-level /generate fields we implement, and SGLang fields accepted only at a neutral value.
_GENERATE_KEYS = {"input_ids", "sampling_params", "return_logprob", "rid", "stream",
                  "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                  "sampling_seed", "seed"}
_NEUTRAL_SAMPLING: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v in (None, 1), "1"),
    "min_new_tokens": (lambda v: v in (None, 0), "0"),
    "min_p": (lambda v: v in (None, 0, 0.0), "0"),
    "frequency_penalty": (lambda v: v in (None, 0, 0.0), "0"),
    "presence_penalty": (lambda v: v in (None, 0, 0.0), "0"),
    "repetition_penalty": (lambda v: v in (None, 1, 1.0), "1"),
    "stop": (lambda v: v in (None, [], ""), "empty (stop strings need a tokenizer; use "
             "stop_token_ids)"),
    "logit_bias": (lambda v: v in (None, {}), "empty"),
    "regex": (lambda v: v is None, "null"), "json_schema": (lambda v: v is None, "null"),
    "ebnf": (lambda v: v is None, "null"), "custom_params": (lambda v: v is None, "null"),
    # Text-only options (we return ids only) and EOS handling (the server knows no EOS token;
    # it stops at stop_token_ids or max_new_tokens): accepted, no effect.
    "skip_special_tokens": (lambda v: isinstance(v, bool), "a bool"),
    "spaces_between_special_tokens": (lambda v: isinstance(v, bool), "a bool"),
    "no_stop_trim": (lambda v: isinstance(v, bool), "a bool"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a bool"),
}
_UPDATE_KEYS = {"model_path", "load_format", "weight_version", "flush_cache",
                "abort_all_requests", "is_async", "torch_empty_cache", "keep_pause",
                "recapture_cuda_graph", "token_step"}


class ApiError(Exception):
  """An HTTP error answered as `{"error": {"message", "type"}}`."""

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status = int(status)
    self.message = message
    self.kind = kind
    self.headers = headers or {}


def _bad(message: str) -> ApiError:
  return ApiError(HTTPStatus.BAD_REQUEST, message)


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """Server settings that are not the model's.

  max_batch / batch_window_s / pad_batch_to: see `Batcher` (pad_batch_to: fixed engine batch
  rows, so only one batch shape is ever compiled). max_prompt_len: longest accepted prompt
  (None: max_position_embeddings - 1). max_new_tokens_limit: None means up to the model's
  max_position_embeddings. api_key: required as `Authorization: Bearer <key>` on every path
  except /health. model_path: reported by /get_model_info.
  """
  max_batch: int = 32
  batch_window_s: float = 0.01
  pad_batch_to: int | None = None
  max_body_bytes: int = 16 << 20
  max_prompts_per_request: int = 1024
  max_prompt_len: int | None = None
  max_new_tokens_limit: int | None = None
  request_timeout_s: float = 600.0
  api_key: str | None = None
  model_path: str = "random-init"
  weight_version: str = "0"
  extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GenerateRequest:
  """A validated /generate request."""
  prompts: list[list[int]]
  sampling: list[SamplingParams]
  return_logprob: list[bool]
  rids: list[str]
  is_batch: bool


# ------------------------------------------------------------------------------- validation

def _parse_prompt(x: Any, where: str, vocab: int, max_len: int) -> list[int]:
  if not isinstance(x, list):
    raise _bad(f"{where} must be a list of token ids, got {type(x).__name__}")
  if not x:
    raise _bad(f"{where} is empty; a prompt needs at least one token")
  bad = [(i, t) for i, t in enumerate(x) if not _is_int(t)]
  if bad:
    i, t = bad[0]
    raise _bad(f"{where}[{i}] = {t!r} is not an integer token id")
  oov = [(i, t) for i, t in enumerate(x) if not 0 <= t < vocab]
  if oov:
    i, t = oov[0]
    raise _bad(f"{where}[{i}] = {t} is outside the vocabulary [0, {vocab}) "
               f"({len(oov)} out-of-vocab ids)")
  if len(x) > max_len:
    raise _bad(f"{where} has {len(x)} tokens; the longest prompt this server accepts is "
               f"{max_len}")
  return list(x)


def parse_sampling(d: Any, where: str, prompt_len: int, max_positions: int,
                   max_new_limit: int | None, max_stop_ids: int) -> SamplingParams:
  """Validates one SGLang `sampling_params` dict (names, types, ranges) into SamplingParams."""
  if d is None:
    d = {}
  if not isinstance(d, dict):
    raise _bad(f"{where} must be an object, got {type(d).__name__}")
  d = dict(d)
  for key in list(d):
    if key in _NEUTRAL_SAMPLING:
      ok, neutral = _NEUTRAL_SAMPLING[key]
      if not ok(d[key]):
        raise _bad(f"{where}.{key} = {d[key]!r} is not supported by this server (only "
                   f"{neutral})")
      del d[key]
  unknown = sorted(set(d) - _SAMPLING_KEYS)
  if unknown:
    raise _bad(f"{where} has unsupported keys {unknown}; supported: "
               f"{sorted(_SAMPLING_KEYS | set(_NEUTRAL_SAMPLING))}")
  if "max_new_tokens" in d:
    v = d["max_new_tokens"]
    if not _is_int(v) or v < 1:
      raise _bad(f"{where}.max_new_tokens must be an integer >= 1, got {v!r}")
  max_new = d.get("max_new_tokens", SamplingParams.max_new_tokens)
  if max_new_limit is not None and max_new > max_new_limit:
    raise _bad(f"{where}.max_new_tokens = {max_new} exceeds this server's limit "
               f"{max_new_limit}")
  if prompt_len + max_new > max_positions:
    raise _bad(f"{where}: prompt of {prompt_len} tokens + max_new_tokens {max_new} exceeds the "
               f"model's max_position_embeddings {max_positions}")
  if "temperature" in d and (not _is_num(d["temperature"]) or d["temperature"] < 0):
    raise _bad(f"{where}.temperature must be a finite number >= 0, got {d['temperature']!r}")
  if "top_p" in d and (not _is_num(d["top_p"]) or not 0 < d["top_p"] <= 1):
    raise _bad(f"{where}.top_p must be a number in (0, 1], got {d['top_p']!r}")
  if "top_k" in d and (not _is_int(d["top_k"]) or not (d["top_k"] == -1 or d["top_k"] >= 1)):
    raise _bad(f"{where}.top_k must be -1 (disabled) or an integer >= 1, got {d['top_k']!r}")
  stops = d.get("stop_token_ids")
  if stops is not None:
    if not isinstance(stops, list) or not all(_is_int(t) and t >= 0 for t in stops):
      raise _bad(f"{where}.stop_token_ids must be a list of non-negative integers, got "
                 f"{stops!r}")
    if len(stops) > max_stop_ids:
      raise _bad(f"{where}.stop_token_ids has {len(stops)} ids; at most {max_stop_ids}")
  for key in ("sampling_seed", "seed"):
    v = d.get(key)
    if v is not None and (not _is_int(v) or not 0 <= v < SEED_LIMIT):
      raise _bad(f"{where}.{key} must be an integer in [0, 2**32), got {v!r}")
  try:
    return SamplingParams.from_sglang(d)
  except (TypeError, ValueError) as e:
    raise _bad(f"{where}: {e}") from e


def parse_generate(body: Any, *, vocab_size: int, max_positions: int, max_prompt_len: int,
                   max_new_limit: int | None = None, max_prompts: int = 1024,
                   max_stop_ids: int = DEFAULT_MAX_STOP_IDS) -> GenerateRequest:
  """Validates a /generate body (SGLang `GenerateReqInput` subset)."""
  if not isinstance(body, dict):
    raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
  unknown = sorted(k for k in set(body) - _GENERATE_KEYS if body[k] is not None)
  if unknown:
    if "text" in unknown:
      raise _bad("this server has no tokenizer: send token ids in `input_ids`, not `text`")
    raise _bad(f"unsupported /generate fields {unknown}; supported: {sorted(_GENERATE_KEYS)}")
  if body.get("stream"):
    raise _bad("stream=true is not supported; send stream=false")
  if body.get("logprob_start_len") not in (None, -1):
    raise _bad("only logprob_start_len=-1 (output-token logprobs) is supported, got "
               f"{body['logprob_start_len']!r}")
  if body.get("top_logprobs_num") not in (None, 0):
    raise _bad(f"top_logprobs_num is not supported, got {body['top_logprobs_num']!r}")
  if "input_ids" not in body or body["input_ids"] is None:
    raise _bad("missing `input_ids`: a list of token ids, or a list of such lists for a batch")
  ids = body["input_ids"]
  if not isinstance(ids, list) or not ids:
    raise _bad("`input_ids` must be a non-empty list of token ids or of lists of token ids")
  is_batch = isinstance(ids[0], list)
  raw = ids if is_batch else [ids]
  if len(raw) > max_prompts:
    raise _bad(f"{len(raw)} prompts in one request; at most {max_prompts}")
  prompts = [_parse_prompt(p, f"input_ids[{i}]" if is_batch else "input_ids", vocab_size,
                           max_prompt_len) for i, p in enumerate(raw)]
  n = len(prompts)

  sp = body.get("sampling_params")
  if isinstance(sp, list):
    if not is_batch:
      raise _bad("`sampling_params` is a list but `input_ids` is a single prompt")
    if len(sp) != n:
      raise _bad(f"`sampling_params` has {len(sp)} entries for {n} prompts")
    sps = sp
  else:
    sps = [sp] * n
  sampling = [parse_sampling(s, f"sampling_params[{i}]" if isinstance(sp, list)
                             else "sampling_params", len(prompts[i]), max_positions,
                             max_new_limit, max_stop_ids) for i, s in enumerate(sps)]

  rl = body.get("return_logprob", False)
  if rl is None:
    rl = False
  if isinstance(rl, list):
    if not is_batch or len(rl) != n or not all(isinstance(x, bool) for x in rl):
      raise _bad(f"`return_logprob` must be a bool or a list of {n} bools")
    rls = list(rl)
  elif isinstance(rl, bool):
    rls = [rl] * n
  else:
    raise _bad(f"`return_logprob` must be a bool, got {rl!r}")

  rid = body.get("rid")
  if rid is None:
    rids = [uuid.uuid4().hex for _ in range(n)]
  elif isinstance(rid, list) and is_batch and len(rid) == n and all(
      isinstance(r, str) for r in rid):
    rids = list(rid)
  elif isinstance(rid, str) and not is_batch:
    rids = [rid]
  else:
    raise _bad("`rid` must be a string (one prompt) or a list of strings, one per prompt")
  return GenerateRequest(prompts, sampling, rls, rids, is_batch)


def sglang_output(sample: Sample, rid: str, return_logprob: bool, weight_version: str,
                  latency_s: float) -> dict[str, Any]:
  """One request's answer in SGLang's shape, plus meta_info.trace_guidance."""
  if sample.finish_reason == "stop":
    finish = {"type": "stop", "matched": sample.tokens[-1]}
  else:
    finish = {"type": "length", "length": len(sample.tokens)}
  meta: dict[str, Any] = {
      "id": rid, "prompt_tokens": len(sample.prompt), "completion_tokens": len(sample.tokens),
      "cached_tokens": 0, "finish_reason": finish, "weight_version": weight_version,
      "e2e_latency": latency_s}
  if return_logprob:
    meta["output_token_logprobs"] = [[float(lp), int(t), None]
                                     for lp, t in zip(sample.logprobs, sample.tokens)]
  if sample.guidance is not None:
    g = sample.guidance
    meta["trace_guidance"] = {"store": g.get("store"), "batch_id": g.get("batch_id"),
                              "seq_id": g.get("seq_id"),
                              "guidance_bytes_per_token": g.get("guidance_bytes_per_token")}
  return {"output_ids": [int(t) for t in sample.tokens], "meta_info": meta}


# ------------------------------------------------------------------------------- the app

class RolloutServer:
  """The HTTP server around one engine (an `InProcessEngine`, or anything with its surface).

  The engine needs `config` (a ModelConfig), `generate`, `update_weights` and `close`;
  `weights_version`, `writer` (a GuidanceWriter) and `record` are used when present.
  `start()` serves on a background thread (tests, notebooks); `serve_forever()` blocks.
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
    self.httpd = _HTTPServer((host, port), _Handler)
    self.httpd.app = self
    self._thread: threading.Thread | None = None

  # ---------------------------------------------------------------------------- lifecycle

  @property
  def host(self) -> str:
    return self.httpd.server_address[0]

  @property
  def port(self) -> int:
    return self.httpd.server_address[1]

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self) -> RolloutServer:
    """Serves on a daemon thread; returns at once."""
    self.batcher.start()
    self._thread = threading.Thread(target=self.httpd.serve_forever, name="rollout-http",
                                    daemon=True)
    self._thread.start()
    return self

  def serve_forever(self) -> None:
    self.batcher.start()
    self.httpd.serve_forever()

  def stop(self, close_engine: bool = False) -> None:
    """Stops accepting requests, fails queued jobs, optionally closes the engine."""
    if self._thread is not None:
      self.httpd.shutdown()
    self.httpd.server_close()
    self.batcher.stop()
    if self._thread is not None:
      self._thread.join(10)
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

  def generate(self, body: Any) -> Any:
    t0 = time.perf_counter()
    req = parse_generate(body, vocab_size=self.vocab_size, max_positions=self.max_positions,
                         max_prompt_len=self.max_prompt_len,
                         max_new_limit=self.options.max_new_tokens_limit,
                         max_prompts=self.options.max_prompts_per_request,
                         max_stop_ids=self.max_stop_ids)
    try:
      job = self.batcher.submit(req.prompts, req.sampling)
      samples = job.wait(self.options.request_timeout_s)
    except BatcherClosed as e:
      raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(e), "unavailable") from e
    except TimeoutError as e:
      raise ApiError(HTTPStatus.GATEWAY_TIMEOUT, str(e), "timeout") from e
    except ValueError as e:  # the engine refused something our validation let through
      raise _bad(f"generation rejected: {e}") from e
    except Exception as e:
      log.exception("generation failed")
      raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                     f"generation failed: {type(e).__name__}: {e}", "server_error") from e
    dt = time.perf_counter() - t0
    out = [sglang_output(s, rid, rl, self.weight_version(s.meta.get("weights_version")), dt)
           for s, rid, rl in zip(samples, req.rids, req.return_logprob)]
    return out if req.is_batch else out[0]

  def update_weights_from_disk(self, body: Any) -> tuple[int, dict[str, Any]]:
    if not isinstance(body, dict):
      raise _bad("the request body must be a JSON object with `model_path`")
    unknown = sorted(k for k in set(body) - _UPDATE_KEYS if body[k] is not None)
    if unknown:
      raise _bad(f"unsupported /update_weights_from_disk fields {unknown}; supported: "
                 f"{sorted(_UPDATE_KEYS)}")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
      raise _bad("missing `model_path`: the directory of an HF safetensors checkpoint")
    if body.get("load_format") not in (None, "auto", "safetensors"):
      raise _bad(f"load_format {body['load_format']!r} is not supported (auto/safetensors)")
    label = body.get("weight_version")
    if label is not None and not isinstance(label, str):
      raise _bad(f"`weight_version` must be a string, got {label!r}")
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
    writer = getattr(self.engine, "writer", None)
    record = bool(getattr(self.engine, "record", cfg.policy == "fp4_trace"))
    last = self.batcher.stats()["last_batch"]
    return {
        "enabled": record, "policy": cfg.policy,
        "store": getattr(writer, "root", None) if writer is not None else None,
        "config_hash": getattr(writer, "config_hash", None),
        "mode": cfg.guidance_mode, "guided_layers": list(cfg.guided_layers) if record else [],
        "sites": list(GUIDANCE_SITES) if record else [], "routing": record,
        "last_batch": None if last is None else {
            k: last[k] for k in ("guidance_batch_id", "guidance_store",
                                 "guidance_bytes_per_token", "prompts", "rows",
                                 "generated_tokens")},
    }

  def stats(self) -> dict[str, Any]:
    with self._counts_lock:
      counts = dict(self._counts)
    return {"http": counts, "batcher": self.batcher.stats(),
            "weight_version": self.weight_version()}


# ------------------------------------------------------------------------------- HTTP layer

class _HTTPServer(ThreadingHTTPServer):
  daemon_threads = True
  allow_reuse_address = True
  app: RolloutServer


_ROUTES: dict[str, tuple[str, ...]] = {
    "/generate": ("POST",), "/update_weights_from_disk": ("POST",),
    "/flush_cache": ("GET", "POST"), "/health": ("GET",), "/get_model_info": ("GET",),
    "/trace/guidance": ("GET",), "/trace/stats": ("GET",)}


class _Handler(BaseHTTPRequestHandler):
  """Routes, reads bodies with limits, and turns every failure into a JSON error."""

  protocol_version = "HTTP/1.1"
  server_version = "trace-jax-rollout/0.1"
  timeout = 60  # socket timeout: a client that stops sending mid-body is dropped
  server: _HTTPServer

  def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
    log.debug("%s - %s", self.address_string(), format % args)

  def send_error(self, code: int, message: str | None = None, explain: str | None = None
                 ) -> None:
    """Errors raised by http.server itself (bad request line, ...) as JSON too."""
    self.close_connection = True
    try:
      msg = message or HTTPStatus(code).phrase
    except ValueError:
      msg = message or "error"
    self._send_json(code, {"error": {"message": msg, "type": "invalid_request_error"}})

  def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(obj).encode()
    self.send_response(int(status))
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
      self.send_header(k, v)
    if self.close_connection:
      self.send_header("Connection", "close")
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(data)

  def _read_json(self, required: bool = True) -> Any:
    if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
      self.close_connection = True
      raise ApiError(HTTPStatus.LENGTH_REQUIRED, "chunked request bodies are not supported; "
                     "send a Content-Length", "length_required")
    length = self.headers.get("Content-Length")
    if length is None:
      if required:
        self.close_connection = True
        raise ApiError(HTTPStatus.LENGTH_REQUIRED, "missing Content-Length header",
                       "length_required")
      return {}
    try:
      n = int(length)
      if n < 0:
        raise ValueError
    except ValueError:
      self.close_connection = True
      raise _bad(f"invalid Content-Length {length!r}") from None
    limit = self.server.app.options.max_body_bytes
    if n > limit:
      self.close_connection = True  # the body stays unread
      raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body of {n} bytes exceeds "
                     f"the limit of {limit} bytes", "payload_too_large")
    data = self.rfile.read(n) if n else b""
    if len(data) != n:
      self.close_connection = True
      raise _bad(f"request body ended after {len(data)} of {n} bytes")
    if not data.strip():
      if required:
        raise _bad("empty request body; expected a JSON object")
      return {}
    try:
      return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise _bad(f"request body is not valid JSON: {e}") from None

  def _dispatch(self) -> None:
    app = self.server.app
    path = urlsplit(self.path).path.rstrip("/") or "/"
    app.count("requests")
    try:
      methods = _ROUTES.get(path)
      if methods is None:
        raise ApiError(HTTPStatus.NOT_FOUND, f"unknown path {path!r}; endpoints: "
                       f"{sorted(_ROUTES)}", "not_found")
      if self.command not in methods:
        raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} is not allowed on "
                       f"{path}; use {'/'.join(methods)}", "method_not_allowed",
                       {"Allow": ", ".join(methods)})
      app.check_auth(path, self.headers.get("Authorization"))
      status, obj = HTTPStatus.OK, None
      if path == "/generate":
        obj = app.generate(self._read_json())
      elif path == "/update_weights_from_disk":
        status, obj = app.update_weights_from_disk(self._read_json())
      elif path == "/flush_cache":
        if self.command == "POST":
          self._read_json(required=False)
        obj = {"success": True, "message": "Cache flushed (this server keeps no cross-request "
                                           "cache)."}
      elif path == "/health":
        obj = app.health()
      elif path == "/get_model_info":
        obj = app.model_info()
      elif path == "/trace/guidance":
        obj = app.guidance_info()
      elif path == "/trace/stats":
        obj = app.stats()
      if int(status) >= 400:
        app.count("errors_4xx")
      self._send_json(status, obj)
    except ApiError as e:
      app.count("errors_5xx" if e.status >= 500 else "errors_4xx")
      if self.command == "POST" and e.status in (401, 404, 405) and \
          self.headers.get("Content-Length") not in (None, "0"):
        self.close_connection = True  # we did not read the body
      self._send_json(e.status, {"error": {"message": e.message, "type": e.kind}}, e.headers)
    except Exception as e:  # a bug: answer 500 and keep serving
      log.exception("internal error on %s %s", self.command, path)
      app.count("errors_5xx")
      self.close_connection = True
      self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {
          "message": f"internal error: {type(e).__name__}: {e}", "type": "server_error"}})

  do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _dispatch
