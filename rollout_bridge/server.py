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

HTTP stack: uvicorn (h11 protocol, asyncio) with starlette responses, SGLang's own serving stack.
One event loop thread does all HTTP work; `/generate` requests wait for the batcher (which runs
the engine on its own thread) without holding a thread each, so thousands of concurrent
requests cost sockets, not threads. uvicorn's h11 protocol is subclassed (`_Protocol`) for the
deadlines it lacks (request head, idle fresh connections) and for JSON protocol errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import re
import reprlib
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from starlette.datastructures import Headers
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollout_bridge.batcher import Batcher, BatcherClosed, Job
from trace_jax.model.config import SITES
from trace_jax.rollout.protocol import Sample, SamplingParams

log = logging.getLogger(__name__)

SEED_LIMIT = 2**32  # the engine builds PRNG keys from uint32 seeds
INT32_LIMIT = 2**31  # top_k and stop ids travel to the engine as int32
DEFAULT_MAX_STOP_IDS = 8  # trace_jax.rollout.engine._MAX_STOP_IDS
SERVER_NAME = "trace-jax-rollout/0.2"

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

# Client values quoted in error messages are cut short: a message never echoes a 16 MB list,
# and quoting a deeply nested value cannot recurse (builtin repr would raise RecursionError).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 8
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 80, 40, 80


def _show(v: Any) -> str:
  """A bounded repr of a client-supplied value, for error messages."""
  return _REPR.repr(v)


class ApiError(Exception):
  """An HTTP error answered as `{"error": {"message", "type"}}`.

  close: answer with `Connection: close` (the rest of the request cannot be trusted or read).
  """

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               headers: dict[str, str] | None = None, close: bool = False):
    super().__init__(message)
    self.status = int(status)
    self.message = message
    self.kind = kind
    self.headers = headers or {}
    self.close = close


def _bad(message: str) -> ApiError:
  return ApiError(HTTPStatus.BAD_REQUEST, message)


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return False
  try:
    return math.isfinite(v)
  except OverflowError:  # an int beyond float range
    return False


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


@dataclasses.dataclass
class GenerateRequest:
  """A validated /generate request."""
  prompts: list[list[int]]
  sampling: list[SamplingParams]
  return_logprob: list[bool]
  rids: list[str]
  is_batch: bool
  stream: bool = False


# ------------------------------------------------------------------------------- validation

def parse_json_body(data: bytes) -> Any:
  """`json.loads`, with every way client bytes can fail to parse raised as a 400 ApiError.

  Besides syntax errors: invalid UTF-8, nesting deeper than the interpreter's recursion limit
  (RecursionError) and integer literals beyond Python's int-parsing digit limit (ValueError).
  """
  try:
    return json.loads(data)
  except RecursionError:
    raise _bad(f"request body JSON is nested too deeply (the limit is about "
               f"{sys.getrecursionlimit()} levels)") from None
  except UnicodeDecodeError as e:
    raise _bad(f"request body is not valid JSON: not UTF-8 ({e.reason} at byte {e.start})") \
        from None
  except json.JSONDecodeError as e:
    raise _bad(f"request body is not valid JSON: {e}") from None
  except ValueError as e:
    if "integer string conversion" in str(e):
      raise _bad(f"request body JSON has an integer literal of more than "
                 f"{sys.get_int_max_str_digits()} digits") from None
    raise _bad(f"request body is not valid JSON: {e}") from None


def _parse_prompt(x: Any, where: str, vocab: int, max_len: int) -> list[int]:
  if not isinstance(x, list):
    raise _bad(f"{where} must be a list of token ids, got {type(x).__name__}")
  if not x:
    raise _bad(f"{where} is empty; a prompt needs at least one token")
  bad = [(i, t) for i, t in enumerate(x) if not _is_int(t)]
  if bad:
    i, t = bad[0]
    raise _bad(f"{where}[{i}] = {_show(t)} is not an integer token id")
  oov = [(i, t) for i, t in enumerate(x) if not 0 <= t < vocab]
  if oov:
    i, t = oov[0]
    raise _bad(f"{where}[{i}] = {_show(t)} is outside the vocabulary [0, {vocab}) "
               f"({len(oov)} out-of-vocab ids)")
  if len(x) > max_len:
    raise _bad(f"{where} has {len(x)} tokens; the longest prompt this server accepts is "
               f"{max_len}")
  return list(x)


def parse_sampling(d: Any, where: str, prompt_len: int, max_positions: int,
                   max_new_limit: int | None, max_stop_ids: int,
                   vocab_size: int | None = None) -> SamplingParams:
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
        raise _bad(f"{where}.{key} = {_show(d[key])} is not supported by this server (only "
                   f"{neutral})")
      del d[key]
  unknown = sorted(set(d) - _SAMPLING_KEYS)
  if unknown:
    raise _bad(f"{where} has unsupported keys {_show(unknown)}; supported: "
               f"{sorted(_SAMPLING_KEYS | set(_NEUTRAL_SAMPLING))}")
  if "max_new_tokens" in d:
    v = d["max_new_tokens"]
    if not _is_int(v) or v < 1:
      raise _bad(f"{where}.max_new_tokens must be an integer >= 1, got {_show(v)}")
  max_new = d.get("max_new_tokens", SamplingParams.max_new_tokens)
  if max_new_limit is not None and max_new > max_new_limit:
    raise _bad(f"{where}.max_new_tokens = {_show(max_new)} exceeds this server's limit "
               f"{max_new_limit}")
  if prompt_len + max_new > max_positions:
    raise _bad(f"{where}: prompt of {prompt_len} tokens + max_new_tokens {_show(max_new)} "
               f"exceeds the model's max_position_embeddings {max_positions}")
  if "temperature" in d and (not _is_num(d["temperature"]) or d["temperature"] < 0):
    raise _bad(f"{where}.temperature must be a finite number >= 0, got "
               f"{_show(d['temperature'])}")
  if "top_p" in d and (not _is_num(d["top_p"]) or not 0 < d["top_p"] <= 1):
    raise _bad(f"{where}.top_p must be a number in (0, 1], got {_show(d['top_p'])}")
  if "top_k" in d and (not _is_int(d["top_k"]) or
                       not (d["top_k"] == -1 or 1 <= d["top_k"] < INT32_LIMIT)):
    raise _bad(f"{where}.top_k must be -1 (disabled) or an integer in [1, 2**31), got "
               f"{_show(d['top_k'])}")
  stops = d.get("stop_token_ids")
  if stops is not None:
    top = INT32_LIMIT if vocab_size is None else vocab_size
    if not isinstance(stops, list) or not all(_is_int(t) and 0 <= t < top for t in stops):
      raise _bad(f"{where}.stop_token_ids must be a list of token ids in [0, {top}), got "
                 f"{_show(stops)}")
    if len(stops) > max_stop_ids:
      raise _bad(f"{where}.stop_token_ids has {len(stops)} ids; at most {max_stop_ids}")
  for key in ("sampling_seed", "seed"):
    v = d.get(key)
    if v is not None and (not _is_int(v) or not 0 <= v < SEED_LIMIT):
      raise _bad(f"{where}.{key} must be an integer in [0, 2**32), got {_show(v)}")
  try:
    return SamplingParams.from_sglang(d)
  except (TypeError, ValueError, OverflowError) as e:
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
    raise _bad(f"unsupported /generate fields {_show(unknown)}; supported: "
               f"{sorted(_GENERATE_KEYS)}")
  stream = body.get("stream")
  if stream is None:
    stream = False
  if not isinstance(stream, bool):
    raise _bad(f"`stream` must be a bool, got {_show(stream)}")
  if body.get("logprob_start_len") not in (None, -1):
    raise _bad("only logprob_start_len=-1 (output-token logprobs) is supported, got "
               f"{_show(body['logprob_start_len'])}")
  if body.get("top_logprobs_num") not in (None, 0):
    raise _bad(f"top_logprobs_num is not supported, got {_show(body['top_logprobs_num'])}")
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
                             max_new_limit, max_stop_ids, vocab_size)
              for i, s in enumerate(sps)]

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
    raise _bad(f"`return_logprob` must be a bool, got {_show(rl)}")

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
  return GenerateRequest(prompts, sampling, rls, rids, is_batch, stream)


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
    meta["trace_guidance"] = sample.guidance.to_json()
  return {"output_ids": [int(t) for t in sample.tokens], "meta_info": meta}


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
    self._uv: _Uvicorn | None = None
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
    o = self.options
    config = _Config(
        _App(self), http=_Protocol, loop="asyncio", lifespan="off", interface="asgi3",
        ws="none", log_config=None, access_log=False, proxy_headers=False,
        server_header=False, headers=[("server", SERVER_NAME)], backlog=o.backlog,
        timeout_keep_alive=o.keep_alive_s, h11_max_incomplete_event_size=o.max_header_bytes,
        # A backstop only: stop() fails still-queued jobs after graceful_timeout_s, so their
        # requests are answered (503) before uvicorn would cancel them.
        timeout_graceful_shutdown=o.graceful_timeout_s + 60.0)
    config.header_timeout_s = o.header_timeout_s
    self._uv = _Uvicorn(config)
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
      raise _bad(f"generation rejected: {e}") from e
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
      raise _bad("the request body must be a JSON object with `model_path`")
    unknown = sorted(k for k in set(body) - _UPDATE_KEYS if body[k] is not None)
    if unknown:
      raise _bad(f"unsupported /update_weights_from_disk fields {_show(unknown)}; supported: "
                 f"{sorted(_UPDATE_KEYS)}")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
      raise _bad("missing `model_path`: the directory of an HF safetensors checkpoint")
    if body.get("load_format") not in (None, "auto", "safetensors"):
      raise _bad(f"load_format {_show(body['load_format'])} is not supported "
                 "(auto/safetensors)")
    label = body.get("weight_version")
    if label is not None and not isinstance(label, str):
      raise _bad(f"`weight_version` must be a string, got {_show(label)}")
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


# ------------------------------------------------------------------------------- HTTP layer

_ROUTES: dict[str, tuple[str, ...]] = {
    "/generate": ("POST",), "/update_weights_from_disk": ("POST",),
    "/flush_cache": ("GET", "POST"), "/health": ("GET",), "/get_model_info": ("GET",),
    "/trace/guidance": ("GET",), "/trace/stats": ("GET",)}
# Methods answered with 404/405 like any other; the rest are 501, as http.server did.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
_INLINE_BYTES = 64 << 10  # larger bodies are parsed and validated off the event loop
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class _ClientGone(Exception):
  """The client disconnected: there is nobody to answer."""


def json_bytes(obj: Any) -> bytes:
  """`obj` as strict JSON: a NaN or +-Infinity float (which json.dumps would write as the
  bare tokens `NaN`/`Infinity` that JSON parsers reject) becomes null, with a warning."""
  try:
    return json.dumps(obj, allow_nan=False).encode()
  except ValueError:
    log.warning("a response held non-finite numbers (NaN/Inf); they are sent as null")
    return json.dumps(_finite_json(obj), allow_nan=False).encode()


def _finite_json(obj: Any) -> Any:
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else None
  if isinstance(obj, dict):
    return {k: _finite_json(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_finite_json(v) for v in obj]
  return obj


def _json_response(status: int, obj: Any, headers: dict[str, str] | None = None,
                   close: bool = False) -> Response:
  hdrs = dict(headers or {})
  if close:
    hdrs["Connection"] = "close"
  return Response(json_bytes(obj), status_code=int(status), headers=hdrs,
                  media_type="application/json")


def _error_body(message: str, kind: str) -> bytes:
  return json_bytes({"error": {"message": message, "type": kind}})


@dataclasses.dataclass
class _Request:
  """What a handler needs of one HTTP request; `body_done` once the body is fully read."""
  method: str
  path: str
  headers: Headers
  receive: Callable[[], Any]
  body_done: bool = False
  body_size: int = 0

  def has_body(self) -> bool:
    length = self.headers.get("content-length")
    return "chunked" in self.headers.get("transfer-encoding", "").lower() or (
        length is not None and length.strip() not in ("", "0"))


class _App:
  """The ASGI application: auth, routing, bounded body reads, JSON errors, SSE streams."""

  def __init__(self, server: RolloutServer):
    self.server = server

  async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any],
                     send: Callable[[Any], Any]) -> None:
    if scope["type"] != "http":  # lifespan is off and websockets are not served
      return
    s = self.server
    s.count("requests")
    req = _Request(scope["method"], scope["path"].rstrip("/") or "/", Headers(scope=scope),
                   receive)
    try:
      response = await self._route(req)
    except _ClientGone:
      return
    except ApiError as e:
      s.count("errors_5xx" if e.status >= 500 else "errors_4xx")
      # A body we did not read (all of) cannot be skipped reliably: close instead.
      close = e.close or (req.has_body() and not req.body_done)
      response = _json_response(e.status, {"error": {"message": e.message, "type": e.kind}},
                                e.headers, close)
    except Exception as e:  # a bug: answer 500 and keep serving
      log.exception("internal error on %s %s", req.method, req.path)
      s.count("errors_5xx")
      response = _json_response(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {
          "message": f"internal error: {type(e).__name__}: {e}", "type": "server_error"}},
          close=True)
    await response(scope, receive, send)

  async def _route(self, req: _Request) -> Response:
    s = self.server
    s.check_auth(req.path, req.headers.get("authorization"))  # before anything path-specific
    if req.method not in _KNOWN_METHODS:
      raise ApiError(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({req.method!r})",
                     "not_implemented", close=True)
    methods = _ROUTES.get(req.path)
    if methods is None:
      raise ApiError(HTTPStatus.NOT_FOUND, f"unknown path {_show(req.path)}", "not_found")
    if req.method not in methods:
      raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{req.method} is not allowed on "
                     f"{req.path}; use {'/'.join(methods)}", "method_not_allowed",
                     {"Allow": ", ".join(methods)})
    if req.path == "/generate":
      return await self._generate(req)
    if req.path == "/update_weights_from_disk":
      body = await self._read_json(req)
      loop = asyncio.get_running_loop()
      status, obj = await loop.run_in_executor(None, s.update_weights_from_disk, body)
      if int(status) >= 400:
        s.count("errors_4xx")
      return _json_response(status, obj)
    if req.path == "/flush_cache":
      if req.method == "POST":
        await self._read_json(req, required=False)
      return _json_response(HTTPStatus.OK, {
          "success": True, "message": "Cache flushed (this server keeps no cross-request "
                                      "cache)."})
    getters = {"/health": s.health, "/get_model_info": s.model_info,
               "/trace/guidance": s.guidance_info, "/trace/stats": s.stats}
    return _json_response(HTTPStatus.OK, getters[req.path]())

  # ---------------------------------------------------------------------------- bodies

  async def _read_body(self, req: _Request, required: bool) -> bytes | None:
    """The whole body within `body_timeout_s` and `max_body_bytes`; None if there is none."""
    o = self.server.options
    chunked = "chunked" in req.headers.get("transfer-encoding", "").lower()
    length = req.headers.get("content-length")
    if length is None and not chunked:
      if required:
        raise ApiError(HTTPStatus.LENGTH_REQUIRED, "missing Content-Length header",
                       "length_required", close=True)
      req.body_done = True
      return None
    n = None
    if length is not None:
      try:
        n = int(length)
        if n < 0:
          raise ValueError
      except ValueError:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"invalid Content-Length {_show(length)}",
                       close=True) from None
      if n > o.max_body_bytes:  # refused from the header: the body stays unread
        raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body of {n} bytes "
                       f"exceeds the limit of {o.max_body_bytes} bytes", "payload_too_large",
                       close=True)
    parts: list[bytes] = []
    size = 0
    deadline = asyncio.get_running_loop().time() + o.body_timeout_s
    try:
      async with asyncio.timeout_at(deadline):
        while True:
          msg = await req.receive()
          if msg["type"] == "http.disconnect":
            raise _ClientGone
          chunk = msg.get("body", b"")
          size += len(chunk)
          if size > o.max_body_bytes:  # a chunked body can only be measured as it arrives
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body exceeds the "
                           f"limit of {o.max_body_bytes} bytes", "payload_too_large",
                           close=True)
          parts.append(chunk)
          if not msg.get("more_body", False):
            break
    except TimeoutError:
      got = f"{size} of {n}" if n is not None else f"{size}"
      raise ApiError(HTTPStatus.REQUEST_TIMEOUT, f"request body not received within "
                     f"{o.body_timeout_s:g} s ({got} bytes arrived)", "request_timeout",
                     close=True) from None
    req.body_done = True
    req.body_size = size
    return b"".join(parts)

  async def _read_json(self, req: _Request, required: bool = True) -> Any:
    data = await self._read_body(req, required)
    if data is None or not data.strip():
      if required:
        raise _bad("empty request body; expected a JSON object")
      return {}
    return await _offload(len(data), parse_json_body, data)

  # ---------------------------------------------------------------------------- /generate

  async def _generate(self, req: _Request) -> Response:
    s = self.server
    body = await self._read_json(req)
    t0 = time.perf_counter()
    greq = await _offload(req.body_size, s.parse_generate_body, body)
    job = s.submit(greq)
    if greq.stream:
      return StreamingResponse(self._events(greq, job, t0), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    samples = await self._wait(job, req)
    out = s.outputs(greq, samples, t0)
    return _json_response(HTTPStatus.OK, out if greq.is_batch else out[0])

  async def _wait(self, job: Job, req: _Request | None) -> list[Sample]:
    """The job's samples, without a thread per waiting request.

    With `req`, a client that disconnects cancels the job's queued prompts (an RL trainer that
    times out and retries would otherwise leave its abandoned work in the queue).
    """
    s = self.server
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def resolve() -> None:
      if not done.done():
        done.set_result(None)

    def on_done(_job: Job) -> None:  # runs on the batcher thread
      try:
        loop.call_soon_threadsafe(resolve)
      except RuntimeError:  # the loop is closed: the server stopped, nobody is waiting
        pass

    job.add_done_callback(on_done)
    waits: set[asyncio.Future[Any]] = {done}
    gone = None
    if req is not None:
      gone = asyncio.ensure_future(_disconnected(req))
      waits.add(gone)
    try:
      await asyncio.wait(waits, timeout=s.options.request_timeout_s,
                         return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
      s.batcher.cancel(job)
      raise
    finally:
      if gone is not None:
        gone.cancel()
    if done.done():
      return s.job_samples(job)
    s.batcher.cancel(job)
    if gone is not None and gone.done() and not gone.cancelled():
      raise _ClientGone
    raise ApiError(HTTPStatus.GATEWAY_TIMEOUT, f"generation did not finish within "
                   f"{s.options.request_timeout_s} s", "timeout")

  async def _events(self, greq: GenerateRequest, job: Job, t0: float) -> AsyncIterator[bytes]:
    """SGLang's stream: one `data: {chunk}` per prompt (with `index` in a batch), `[DONE]`.

    The engine returns whole generations, so each prompt's one chunk is its final answer
    (finish_reason set). Errors after the stream started are `data: {"error": ...}` chunks, as
    in SGLang. Starlette cancels this generator if the client disconnects.
    """
    s = self.server
    try:
      samples = await self._wait(job, None)
      for i, out in enumerate(s.outputs(greq, samples, t0)):
        if greq.is_batch:
          out["index"] = i
        yield b"data: " + json_bytes(out) + b"\n\n"
    except ApiError as e:
      s.count("errors_5xx" if e.status >= 500 else "errors_4xx")
      err = {"error": {"message": e.message, "type": e.kind, "code": e.status}}
      yield b"data: " + json_bytes(err) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _disconnected(req: _Request) -> None:
  """Returns when the client disconnects (the body is read: nothing else can arrive)."""
  while (await req.receive())["type"] != "http.disconnect":
    pass


async def _offload(size: int, fn: Callable[..., Any], *args: Any) -> Any:
  """fn(*args), on a worker thread for large inputs so the event loop keeps serving."""
  if size < _INLINE_BYTES:
    return fn(*args)
  return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class _Config(uvicorn.Config):
  """uvicorn's Config plus the request-head deadline `_Protocol` enforces."""
  header_timeout_s: float = 10.0


class _Uvicorn(uvicorn.Server):
  """uvicorn's Server that reports when it accepts connections (`ready`, `started`)."""

  def __init__(self, config: uvicorn.Config):
    super().__init__(config)
    self.ready = threading.Event()
    self.error: BaseException | None = None

  async def startup(self, sockets: list[socket.socket] | None = None) -> None:
    await super().startup(sockets=sockets)
    self.ready.set()


LINGER_S = 2.0  # how long a closing connection drains a request body it did not read


class _LingeringTransport:
  """A transport whose close() half-closes, drains unread input, then closes (lingering close).

  When the server answers before reading a request body (413, 408, 401, ...), closing at once
  with unread bytes in the kernel buffer makes the kernel send a reset, and the client often
  loses the answer it was about to read. Instead: send FIN after the answer, discard what
  still arrives, close when the client does or after LINGER_S. Used only while the client is
  mid-request (h11 state SEND_BODY or ERROR); otherwise close() closes.
  """

  def __init__(self, transport: asyncio.Transport, protocol: _Protocol):
    self._t = transport
    self._protocol = protocol
    self.lingering = False
    self._timer: asyncio.TimerHandle | None = None

  def __getattr__(self, name: str) -> Any:
    return getattr(self._t, name)

  def is_closing(self) -> bool:
    return self.lingering or self._t.is_closing()

  def close(self) -> None:
    if self.is_closing():
      return
    if self._protocol.conn.their_state not in (h11.SEND_BODY, h11.ERROR) or \
        not self._t.can_write_eof():
      self._t.close()
      return
    self.lingering = True
    try:
      self._t.write_eof()  # FIN once the answer is flushed; reading stays open
      self._t.resume_reading()
    except (OSError, RuntimeError):
      self._t.close()
      return
    self._timer = self._protocol.loop.call_later(LINGER_S, self._t.close)

  def lost(self) -> None:
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None


class _Protocol(H11Protocol):
  """uvicorn's h11 protocol with the deadlines it lacks, JSON protocol errors, lingering close.

  uvicorn times out idle keep-alive connections only after a response, and nothing else: a
  fresh connection that never sends a byte, or a request head dripped a byte at a time, would
  hold a connection forever. Here a fresh connection gets the keep-alive idle deadline too,
  and a request's head must be complete `header_timeout_s` after its first byte (else 408 and
  close). Protocol errors (bad request line, bad header, head too large) are answered as our
  JSON errors, and an unknown method as 501, as http.server did. Closing mid-request lingers
  (`_LingeringTransport`), so early answers are not lost to a connection reset.
  """

  config: _Config

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self._head_timer: asyncio.TimerHandle | None = None
    self._head = bytearray()  # the first bytes of the request head being received
    self._linger: _LingeringTransport | None = None

  def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
    self._linger = _LingeringTransport(transport, self)  # type: ignore[arg-type]
    super().connection_made(self._linger)  # type: ignore[arg-type]
    self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                        self.timeout_keep_alive_handler)

  def connection_lost(self, exc: Exception | None) -> None:
    self._cancel_head_timer()
    if self._linger is not None:
      self._linger.lost()
    super().connection_lost(exc)

  def data_received(self, data: bytes) -> None:
    if self._linger is not None and self._linger.lingering:
      return  # draining a request we already answered
    if self.conn.their_state is h11.IDLE and data:
      if len(self._head) < 1024:
        self._head += data[:1024 - len(self._head)]
      if self._head_timer is None:
        self._head_timer = self.loop.call_later(self.config.header_timeout_s, self._head_late)
    super().data_received(data)
    if self.conn.their_state is not h11.IDLE:
      self._cancel_head_timer()

  def on_response_complete(self) -> None:
    super().on_response_complete()
    # A pipelined request whose head is only partly buffered gets its deadline now.
    if (not self.transport.is_closing() and self.conn.their_state is h11.IDLE
        and self._head_timer is None and self.conn.trailing_data[0]):
      self._head = bytearray(self.conn.trailing_data[0][:1024])
      self._head_timer = self.loop.call_later(self.config.header_timeout_s, self._head_late)

  def _cancel_head_timer(self) -> None:
    if self._head_timer is not None:
      self._head_timer.cancel()
      self._head_timer = None
    self._head.clear()

  def _head_late(self) -> None:
    self._head_timer = None
    if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
      return
    self._reply_and_close(HTTPStatus.REQUEST_TIMEOUT, f"request head not received within "
                          f"{self.config.header_timeout_s:g} s", "request_timeout")

  def _method(self) -> bytes | None:
    """The method of the request line received so far, if it is a well-formed token."""
    line = bytes(self._head).split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) == 3 and _TOKEN.fullmatch(parts[0]):
      return parts[0]
    return None

  def send_400_response(self, msg: str) -> None:
    """uvicorn calls this on an h11 RemoteProtocolError (the active exception)."""
    exc = sys.exc_info()[1]
    method = self._method()
    if method is not None and method.decode("ascii") not in _KNOWN_METHODS:
      self._reply_and_close(HTTPStatus.NOT_IMPLEMENTED,
                            f"Unsupported method ({method.decode('ascii')!r})",
                            "not_implemented")
      return
    status = int(getattr(exc, "error_status_hint", HTTPStatus.BAD_REQUEST))
    detail = str(exc) if exc is not None else msg
    if len(detail) > 200:
      detail = detail[:200] + "..."
    self._reply_and_close(status, f"invalid HTTP request: {detail}", "invalid_request_error")

  def _reply_and_close(self, status: int, message: str, kind: str) -> None:
    app = self.app
    if isinstance(app, _App):
      app.server.count("errors_5xx" if status >= 500 else "errors_4xx")
    body = _error_body(message, kind)
    try:
      reason = HTTPStatus(status).phrase
    except ValueError:
      reason = ""
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
               (b"server", SERVER_NAME.encode())]
    try:
      for event in (h11.Response(status_code=int(status), reason=reason, headers=headers),
                    h11.Data(data=body), h11.EndOfMessage()):
        self.transport.write(self.conn.send(event))
    except h11.LocalProtocolError:  # a response had already started: just close
      pass
    self.transport.close()
