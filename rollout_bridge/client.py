"""`RolloutEngine` over HTTP: drives our embedded server and a real SGLang server alike.

Speaks SGLang's native API (standard library only): `/generate` with `input_ids`,
`sampling_params` (`SamplingParams.to_sglang()`, so per-request seeds go as `sampling_seed`) and
`return_logprob=True`, parsing `output_ids` and `meta_info.output_token_logprobs`;
`update_weights(path)` posts `/update_weights_from_disk`.

Log-probabilities: our server reports log_softmax of the unscaled logits (temperature 1), the
quantity the trainer recomputes. SGLang by default reports log_softmax(logits / temperature);
start it with `SGLANG_RETURN_ORIGINAL_LOGPROB=1` (or sample at temperature 1) to get the same.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from trace_jax.guidance.handle import GuidanceHandle
from trace_jax.rollout.protocol import Sample, SamplingParams, normalize_request

# The environment variable a server key may come from (server and trainer alike): a key on the
# command line is visible to every local user in `ps`.
API_KEY_ENV = "TRACE_API_KEY"

# Connection-level failures worth retrying: nothing was answered (refused, reset, dropped).
_RETRYABLE = (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine)


def read_api_key_file(path: str) -> str:
  """The key in `path` (surrounding whitespace stripped); ValueError if unreadable or empty."""
  try:
    with open(path, encoding="utf-8") as f:
      key = f.read().strip()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read the API key file {path}: {e}") from e
  if not key:
    raise ValueError(f"the API key file {path} is empty")
  return key


def resolve_api_key(flag_key: str | None, key_file: str | None, config_key: str | None = None,
                    environ: Any = os.environ) -> str | None:
  """The API key (the server's, or the trainer's for its server): --api_key_file or
  --api_key, then $TRACE_API_KEY, then the config's.

  An empty value counts as unset, except an empty key file, which is an error (a deployment
  that points at a key file means to require a key).
  """
  if flag_key and key_file:
    raise ValueError("give --api_key or --api_key_file, not both")
  if key_file:
    return read_api_key_file(key_file)
  return flag_key or environ.get(API_KEY_ENV) or config_key or None


class RolloutHTTPError(RuntimeError):
  """The server answered 4xx/5xx; `message` is the server's own explanation."""

  def __init__(self, status: int, message: str, kind: str | None, method: str, url: str):
    super().__init__(f"{method} {url} -> HTTP {status}: {message}")
    self.status = status
    self.message = message
    self.kind = kind
    self.method = method
    self.url = url


class RolloutProtocolError(RuntimeError):
  """The server answered 2xx with something that is not the expected SGLang shape."""


def _error_message(body: bytes) -> tuple[str, str | None]:
  """The server's message from our JSON error, SGLang's {"message"}, FastAPI's {"detail"}."""
  text = body.decode("utf-8", "replace").strip()
  try:
    obj = json.loads(text)
  except json.JSONDecodeError:
    return text or "(empty body)", None
  if isinstance(obj, dict):
    err = obj.get("error")
    if isinstance(err, dict) and "message" in err:
      return str(err["message"]), err.get("type")
    if isinstance(err, str):
      return err, None
    for key in ("message", "detail"):
      if key in obj:
        return str(obj[key]), None
  return text, None


class _Http:
  """Tiny JSON-over-HTTP helper: one connection per request, bounded retries."""

  def __init__(self, base_url: str, api_key: str | None, timeout: float, retries: int,
               backoff_s: float):
    parts = urlsplit(base_url if "://" in base_url else "http://" + base_url)
    if parts.scheme not in ("http", "https"):
      raise ValueError(f"unsupported URL scheme in {base_url!r}")
    self.base_url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    self._scheme, self._netloc, self._prefix = parts.scheme, parts.netloc, parts.path.rstrip("/")
    self.api_key = api_key
    self.timeout = timeout
    self.retries = retries
    self.backoff_s = backoff_s

  def request(self, method: str, path: str, body: Any = None, timeout: float | None = None
              ) -> Any:
    """JSON (or text, or None for an empty body) of a 2xx answer; raises otherwise."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json"}
    if data is not None:
      headers["Content-Type"] = "application/json"
    if self.api_key:
      headers["Authorization"] = f"Bearer {self.api_key}"
    url = self.base_url + path
    conn_cls = (http.client.HTTPSConnection if self._scheme == "https"
                else http.client.HTTPConnection)
    last: BaseException | None = None
    for attempt in range(self.retries + 1):
      if attempt:
        time.sleep(self.backoff_s * 2 ** (attempt - 1))
      conn = conn_cls(self._netloc, timeout=self.timeout if timeout is None else timeout)
      try:
        conn.request(method, self._prefix + path, body=data, headers=headers)
        resp = conn.getresponse()
        status, payload = resp.status, resp.read()
      except _RETRYABLE as e:
        last = e
        continue
      except TimeoutError as e:
        raise TimeoutError(f"{method} {url}: no answer within {conn.timeout} s") from e
      finally:
        conn.close()
      if status >= 400:
        msg, kind = _error_message(payload)
        raise RolloutHTTPError(status, msg, kind, method, url)
      if not payload.strip():
        return None
      try:
        return json.loads(payload)
      except json.JSONDecodeError:
        return payload.decode("utf-8", "replace")
    raise ConnectionError(f"{method} {url}: no connection after {self.retries + 1} attempts "
                          f"({type(last).__name__}: {last})") from last


def _finish_reason(meta: dict[str, Any], rid: Any) -> str:
  fr = meta.get("finish_reason")
  kind = fr.get("type") if isinstance(fr, dict) else fr
  if kind in ("stop", "length"):
    return kind
  if kind == "abort":
    msg = fr.get("message") if isinstance(fr, dict) else None
    raise RolloutProtocolError(f"request {rid} was aborted by the server"
                               f"{': ' + str(msg) if msg else ''} (e.g. by a weight update); "
                               "generate it again")
  raise RolloutProtocolError(f"request {rid}: unexpected finish_reason {fr!r}")


def parse_output(out: Any, prompt: Sequence[int]) -> Sample:
  """One SGLang /generate answer -> Sample (checks logprobs line up with output_ids)."""
  if not isinstance(out, dict) or "output_ids" not in out or "meta_info" not in out:
    raise RolloutProtocolError(f"not an SGLang /generate answer (need output_ids and "
                               f"meta_info): {str(out)[:200]}")
  tokens = [int(t) for t in out["output_ids"]]
  meta = dict(out["meta_info"])
  rid = meta.get("id")
  lps = meta.pop("output_token_logprobs", None)
  if lps is None:
    raise RolloutProtocolError(f"request {rid}: no meta_info.output_token_logprobs (was "
                               "return_logprob sent?)")
  lp_ids = [int(e[1]) for e in lps]
  if lp_ids != tokens:
    raise RolloutProtocolError(f"request {rid}: output_token_logprobs token ids {lp_ids[:8]}... "
                               f"({len(lp_ids)}) do not match output_ids {tokens[:8]}... "
                               f"({len(tokens)})")
  guidance = meta.pop("trace_guidance", None)
  if guidance is not None:
    try:
      guidance = GuidanceHandle.from_json(guidance)
    except ValueError as e:
      raise RolloutProtocolError(f"request {rid}: bad meta_info.trace_guidance: {e}") from None
  finish = _finish_reason(meta, rid)
  return Sample(prompt=list(map(int, prompt)), tokens=tokens,
                logprobs=[float(e[0]) for e in lps], finish_reason=finish, guidance=guidance,
                meta=meta)


class HttpRolloutEngine:
  """`RolloutEngine` for a server speaking SGLang's native API (ours or SGLang itself).

  base_url: e.g. "http://127.0.0.1:30000". api_key: sent as a Bearer token. timeout: seconds
  per HTTP request (a generation call included). retries: extra attempts on connection
  errors (refused, reset), with exponential backoff from backoff_s; HTTP errors are not retried.
  """

  def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
               retries: int = 3, backoff_s: float = 0.25):
    self._http = _Http(base_url, api_key, timeout, retries, backoff_s)
    self.base_url = self._http.base_url

  # ---------------------------------------------------------------------------- protocol

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams]) -> list[Sample]:
    """All prompts in one batched /generate request; one Sample per prompt, in order."""
    prompts, sampling = normalize_request(prompts, sampling)
    if not prompts:
      return []
    body = {"input_ids": prompts, "sampling_params": [s.to_sglang() for s in sampling],
            "return_logprob": True}
    out = self._http.request("POST", "/generate", body)
    if not isinstance(out, list) or len(out) != len(prompts):
      raise RolloutProtocolError(f"/generate: expected a list of {len(prompts)} answers, got "
                                 f"{type(out).__name__}"
                                 f"{f' of {len(out)}' if isinstance(out, list) else ''}")
    return [parse_output(o, p) for o, p in zip(out, prompts)]

  def update_weights(self, path_or_params: Any, weight_version: str | None = None) -> None:
    """Loads an HF safetensors directory on the server (`/update_weights_from_disk`).

    The path must be readable by the server (same machine or shared storage). In-memory params
    cannot cross HTTP: write them with `trace_jax.io.hf.save_hf_checkpoint` first.
    """
    if not isinstance(path_or_params, (str, os.PathLike)):
      raise TypeError("HttpRolloutEngine.update_weights takes a checkpoint directory; write the "
                      "params with trace_jax.io.hf.save_hf_checkpoint(path, config, params) "
                      "and pass the path")
    body: dict[str, Any] = {"model_path": os.path.abspath(os.fspath(path_or_params))}
    if weight_version is not None:
      body["weight_version"] = weight_version
    out = self._http.request("POST", "/update_weights_from_disk", body)
    if isinstance(out, dict) and out.get("success") is False:  # SGLang may answer 200 + false
      raise RolloutHTTPError(200, str(out.get("message")), None, "POST",
                             self.base_url + "/update_weights_from_disk")

  def close(self) -> None:
    """Nothing to release: every request uses its own connection."""

  # ---------------------------------------------------------------------------- extras

  def health(self) -> bool:
    try:
      self._http.request("GET", "/health", timeout=min(self._http.timeout, 10.0))
      return True
    except (RolloutHTTPError, ConnectionError, TimeoutError, OSError):
      return False

  def flush_cache(self) -> None:
    self._http.request("POST", "/flush_cache")

  def model_info(self) -> dict[str, Any]:
    return self._http.request("GET", "/get_model_info")

  def guidance_info(self) -> dict[str, Any]:
    """Our server's guidance extension (`/trace/guidance`); SGLang answers 404."""
    return self._http.request("GET", "/trace/guidance")

  def stats(self) -> dict[str, Any]:
    """Our server's batching counters (`/trace/stats`)."""
    return self._http.request("GET", "/trace/stats")

  def __enter__(self) -> HttpRolloutEngine:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def wait_healthy(url: str, timeout: float = 60.0, api_key: str | None = None,
                 interval_s: float = 0.2) -> None:
  """Polls GET /health until it answers 2xx; raises TimeoutError with the last failure."""
  http_ = _Http(url, api_key, timeout=min(5.0, max(timeout, 0.1)), retries=0,
                backoff_s=0.0)
  deadline = time.monotonic() + timeout
  last: BaseException | None = None
  while True:
    try:
      http_.request("GET", "/health")
      return
    except (RolloutHTTPError, ConnectionError, TimeoutError, OSError) as e:
      last = e
    if time.monotonic() >= deadline:
      raise TimeoutError(f"{http_.base_url}/health not healthy after {timeout} s (last: "
                         f"{type(last).__name__}: {last})")
    time.sleep(interval_s)
