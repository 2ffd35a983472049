"""The rollout server's HTTP layer: uvicorn (h11, asyncio) with starlette responses.

`make_uvicorn(server)` builds the uvicorn server of a `RolloutServer`: the ASGI app (`_App`:
auth before routing, bounded body reads, JSON errors, server-sent event streams) and uvicorn's
h11 protocol subclassed (`_Protocol`) for the deadlines it lacks (request head, idle fresh
connections), JSON protocol errors, and lingering closes (`_LingeringTransport`). One event
loop thread does all HTTP work; `/generate` requests wait for the batcher without holding a
thread each. docs/reliability.md lists the promises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from starlette.datastructures import Headers
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollout_bridge.api import (
  ApiError,
  GenerateRequest,
  bad_request,
  json_bytes,
  parse_json_body,
  show,
)
from rollout_bridge.batcher import Job
from trace_jax.rollout.protocol import Sample

log = logging.getLogger(__name__)

SERVER_NAME = "trace-jax-rollout/0.2"

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

  def __init__(self, server: Any):  # a rollout_bridge.server.RolloutServer
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
      raise ApiError(HTTPStatus.NOT_FOUND, f"unknown path {show(req.path)}", "not_found")
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
        raise ApiError(HTTPStatus.BAD_REQUEST, f"invalid Content-Length {show(length)}",
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
        raise bad_request("empty request body; expected a JSON object")
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


class UvicornServer(uvicorn.Server):
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


def make_uvicorn(server: Any) -> UvicornServer:
  """The uvicorn server that answers the HTTP of `server`, a `rollout_bridge.server.
  RolloutServer` (run it on the server's socket). The transport takes the server as it is
  given, so it imports nothing of it."""
  o = server.options
  config = _Config(
    _App(server), http=_Protocol, loop="asyncio", lifespan="off", interface="asgi3",
    ws="none", log_config=None, access_log=False, proxy_headers=False,
    server_header=False, headers=[("server", SERVER_NAME)], backlog=o.backlog,
    timeout_keep_alive=o.keep_alive_s, h11_max_incomplete_event_size=o.max_header_bytes,
    # A backstop only: stop() fails still-queued jobs after graceful_timeout_s, so their
    # requests are answered (503) before uvicorn would cancel them.
    timeout_graceful_shutdown=o.graceful_timeout_s + 60.0)
  config.header_timeout_s = o.header_timeout_s
  return UvicornServer(config)
