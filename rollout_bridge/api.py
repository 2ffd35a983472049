"""The subset of SGLang's native HTTP API that RL needs: request parsing and answer shapes.

`parse_generate` turns a `/generate` body into a validated `GenerateRequest` or raises
`ApiError` (a 4xx `{"error": {"message", "type"}}` naming the field), so a bad request never
reaches the batcher; `sglang_output` is one prompt's answer in SGLang's shape; `json_bytes`
writes strict JSON (a non-finite number becomes null). No HTTP and no engine here: the server
(`rollout_bridge.server`) and the transport (`rollout_bridge.transport`) use these.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import reprlib
import sys
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from trace_jax.rollout.protocol import Sample, SamplingParams

log = logging.getLogger(__name__)

SEED_LIMIT = 2**32  # the engine builds PRNG keys from uint32 seeds
INT32_LIMIT = 2**31  # top_k and stop ids travel to the engine as int32
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
UPDATE_KEYS = {"model_path", "load_format", "weight_version", "flush_cache",
                "abort_all_requests", "is_async", "torch_empty_cache", "keep_pause",
                "recapture_cuda_graph", "token_step"}

# Client values quoted in error messages are cut short: a message never echoes a 16 MB list,
# and quoting a deeply nested value cannot recurse (builtin repr would raise RecursionError).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 8
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 80, 40, 80


def show(v: Any) -> str:
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


def bad_request(message: str) -> ApiError:
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
    raise bad_request(f"request body JSON is nested too deeply (the limit is about "
               f"{sys.getrecursionlimit()} levels)") from None
  except UnicodeDecodeError as e:
    raise bad_request(f"request body is not valid JSON: not UTF-8 ({e.reason} at byte {e.start})") \
        from None
  except json.JSONDecodeError as e:
    raise bad_request(f"request body is not valid JSON: {e}") from None
  except ValueError as e:
    if "integer string conversion" in str(e):
      raise bad_request(f"request body JSON has an integer literal of more than "
                 f"{sys.get_int_max_str_digits()} digits") from None
    raise bad_request(f"request body is not valid JSON: {e}") from None


def _parse_prompt(x: Any, where: str, vocab: int, max_len: int) -> list[int]:
  if not isinstance(x, list):
    raise bad_request(f"{where} must be a list of token ids, got {type(x).__name__}")
  if not x:
    raise bad_request(f"{where} is empty; a prompt needs at least one token")
  bad = [(i, t) for i, t in enumerate(x) if not _is_int(t)]
  if bad:
    i, t = bad[0]
    raise bad_request(f"{where}[{i}] = {show(t)} is not an integer token id")
  oov = [(i, t) for i, t in enumerate(x) if not 0 <= t < vocab]
  if oov:
    i, t = oov[0]
    raise bad_request(f"{where}[{i}] = {show(t)} is outside the vocabulary [0, {vocab}) "
               f"({len(oov)} out-of-vocab ids)")
  if len(x) > max_len:
    raise bad_request(f"{where} has {len(x)} tokens; the longest prompt this server accepts is "
               f"{max_len}")
  return list(x)


def parse_sampling(d: Any, where: str, prompt_len: int, max_positions: int,
                   max_new_limit: int | None, max_stop_ids: int,
                   vocab_size: int | None = None) -> SamplingParams:
  """Validates one SGLang `sampling_params` dict (names, types, ranges) into SamplingParams."""
  if d is None:
    d = {}
  if not isinstance(d, dict):
    raise bad_request(f"{where} must be an object, got {type(d).__name__}")
  d = dict(d)
  for key in list(d):
    if key in _NEUTRAL_SAMPLING:
      ok, neutral = _NEUTRAL_SAMPLING[key]
      if not ok(d[key]):
        raise bad_request(f"{where}.{key} = {show(d[key])} is not supported by this server (only "
                   f"{neutral})")
      del d[key]
  unknown = sorted(set(d) - _SAMPLING_KEYS)
  if unknown:
    raise bad_request(f"{where} has unsupported keys {show(unknown)}; supported: "
               f"{sorted(_SAMPLING_KEYS | set(_NEUTRAL_SAMPLING))}")
  if "max_new_tokens" in d:
    v = d["max_new_tokens"]
    if not _is_int(v) or v < 1:
      raise bad_request(f"{where}.max_new_tokens must be an integer >= 1, got {show(v)}")
  max_new = d.get("max_new_tokens", SamplingParams.max_new_tokens)
  if max_new_limit is not None and max_new > max_new_limit:
    raise bad_request(f"{where}.max_new_tokens = {show(max_new)} exceeds this server's limit "
               f"{max_new_limit}")
  if prompt_len + max_new > max_positions:
    raise bad_request(f"{where}: prompt of {prompt_len} tokens + max_new_tokens {show(max_new)} "
               f"exceeds the model's max_position_embeddings {max_positions}")
  if "temperature" in d and (not _is_num(d["temperature"]) or d["temperature"] < 0):
    raise bad_request(f"{where}.temperature must be a finite number >= 0, got "
               f"{show(d['temperature'])}")
  if "top_p" in d and (not _is_num(d["top_p"]) or not 0 < d["top_p"] <= 1):
    raise bad_request(f"{where}.top_p must be a number in (0, 1], got {show(d['top_p'])}")
  if "top_k" in d and (not _is_int(d["top_k"]) or
                       not (d["top_k"] == -1 or 1 <= d["top_k"] < INT32_LIMIT)):
    raise bad_request(f"{where}.top_k must be -1 (disabled) or an integer in [1, 2**31), got "
               f"{show(d['top_k'])}")
  stops = d.get("stop_token_ids")
  if stops is not None:
    top = INT32_LIMIT if vocab_size is None else vocab_size
    if not isinstance(stops, list) or not all(_is_int(t) and 0 <= t < top for t in stops):
      raise bad_request(f"{where}.stop_token_ids must be a list of token ids in [0, {top}), got "
                 f"{show(stops)}")
    if len(stops) > max_stop_ids:
      raise bad_request(f"{where}.stop_token_ids has {len(stops)} ids; at most {max_stop_ids}")
  for key in ("sampling_seed", "seed"):
    v = d.get(key)
    if v is not None and (not _is_int(v) or not 0 <= v < SEED_LIMIT):
      raise bad_request(f"{where}.{key} must be an integer in [0, 2**32), got {show(v)}")
  try:
    return SamplingParams.from_sglang(d)
  except (TypeError, ValueError, OverflowError) as e:
    raise bad_request(f"{where}: {e}") from e


def parse_generate(body: Any, *, vocab_size: int, max_positions: int, max_prompt_len: int,
                   max_new_limit: int | None = None, max_prompts: int = 1024,
                   max_stop_ids: int = DEFAULT_MAX_STOP_IDS) -> GenerateRequest:
  """Validates a /generate body (SGLang `GenerateReqInput` subset)."""
  if not isinstance(body, dict):
    raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
  unknown = sorted(k for k in set(body) - _GENERATE_KEYS if body[k] is not None)
  if unknown:
    if "text" in unknown:
      raise bad_request("this server has no tokenizer: send token ids in `input_ids`, not `text`")
    raise bad_request(f"unsupported /generate fields {show(unknown)}; supported: "
               f"{sorted(_GENERATE_KEYS)}")
  stream = body.get("stream")
  if stream is None:
    stream = False
  if not isinstance(stream, bool):
    raise bad_request(f"`stream` must be a bool, got {show(stream)}")
  if body.get("logprob_start_len") not in (None, -1):
    raise bad_request("only logprob_start_len=-1 (output-token logprobs) is supported, got "
               f"{show(body['logprob_start_len'])}")
  if body.get("top_logprobs_num") not in (None, 0):
    raise bad_request(f"top_logprobs_num is not supported, got {show(body['top_logprobs_num'])}")
  if "input_ids" not in body or body["input_ids"] is None:
    raise bad_request("missing `input_ids`: a list of token ids, or a list of such lists for a "
                      "batch")
  ids = body["input_ids"]
  if not isinstance(ids, list) or not ids:
    raise bad_request("`input_ids` must be a non-empty list of token ids or of lists of token ids")
  is_batch = isinstance(ids[0], list)
  raw = ids if is_batch else [ids]
  if len(raw) > max_prompts:
    raise bad_request(f"{len(raw)} prompts in one request; at most {max_prompts}")
  prompts = [_parse_prompt(p, f"input_ids[{i}]" if is_batch else "input_ids", vocab_size,
                           max_prompt_len) for i, p in enumerate(raw)]
  n = len(prompts)

  sp = body.get("sampling_params")
  if isinstance(sp, list):
    if not is_batch:
      raise bad_request("`sampling_params` is a list but `input_ids` is a single prompt")
    if len(sp) != n:
      raise bad_request(f"`sampling_params` has {len(sp)} entries for {n} prompts")
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
      raise bad_request(f"`return_logprob` must be a bool or a list of {n} bools")
    rls = list(rl)
  elif isinstance(rl, bool):
    rls = [rl] * n
  else:
    raise bad_request(f"`return_logprob` must be a bool, got {show(rl)}")

  rid = body.get("rid")
  if rid is None:
    rids = [uuid.uuid4().hex for _ in range(n)]
  elif isinstance(rid, list) and is_batch and len(rid) == n and all(
      isinstance(r, str) for r in rid):
    rids = list(rid)
  elif isinstance(rid, str) and not is_batch:
    rids = [rid]
  else:
    raise bad_request("`rid` must be a string (one prompt) or a list of strings, one per prompt")
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


