"""The rollout HTTP server over real loopback HTTP, with the tiny fp4_trace model.

One server (and one reference in-process engine) for the whole module. Every engine call is
padded to the same 32 rows with prompts <= 16 tokens and <= 16 new tokens, so the suite
compiles the generation program once; the reference engine shares that compiled program.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_bridge import serve
from rollout_bridge.batcher import Batcher, BatcherClosed, pad_batch
from rollout_bridge.client import HttpRolloutEngine, RolloutHTTPError
from rollout_bridge.server import RolloutServer, ServerOptions
from trace_jax import model as model_lib
from trace_jax.guidance import store as guidance_store
from trace_jax.io import hf
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import Sample, SamplingParams

ROWS = 32  # every engine call has this many rows: one compiled batch shape
CFG = model_lib.tiny(policy="fp4_trace")


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def params0():
  return model_lib.init_params(CFG, 0)


@pytest.fixture(scope="module")
def engine(params0, tmp_path_factory):
  store = guidance_store.GuidanceStore(
      str(tmp_path_factory.mktemp("guidance")), guidance_store.config_hash(CFG),
      options=guidance_store.StoreOptions(fsync=False))
  eng = InProcessEngine(params0, CFG, guidance_store=store)  # what serve.py runs
  yield eng
  eng.close()
  store.close()


@pytest.fixture(scope="module")
def server(engine):
  opts = ServerOptions(max_batch=ROWS, batch_window_s=0.02, pad_batch_to=ROWS,
                       model_path="random-init:tiny(seed=0)")
  srv = RolloutServer(engine, opts).start()
  yield srv
  srv.stop()


def ref_engine(params: Any) -> InProcessEngine:
  """An in-process engine on `params` without a guidance store (the server's tokens and
  log-probs must equal it)."""
  return InProcessEngine(params, CFG)


@pytest.fixture(scope="module")
def reference(params0):
  return ref_engine(params0)


def ref_generate(eng: InProcessEngine, prompts: list[list[int]],
                 sampling: list[SamplingParams]) -> list[Sample]:
  """The reference answers, run in the server's padded batch shape."""
  p, s = pad_batch(prompts, sampling, ROWS)
  return eng.generate(p, s)[:len(prompts)]


def request(url: str, method: str, path: str, body: Any = None, raw: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, Any]:
  """(status, parsed JSON) of one HTTP request on a fresh connection."""
  host, port = url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=600)
  data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
  try:
    conn.request(method, path, body=data, headers=headers or {})
    resp = conn.getresponse()
    text = resp.read()
  finally:
    conn.close()
  return resp.status, (json.loads(text) if text else None)


def prompt(i: int, n: int) -> list[int]:
  return [(37 * i + 11 * j + 5) % CFG.vocab_size for j in range(n)]


# ------------------------------------------------------------------------------ bad requests

G = "/generate"
BAD = [
    ("bad_json", "POST", G, b'{"input_ids": [1, 2', 400, "not valid JSON"),
    ("not_utf8", "POST", G, b"\xff\xfe", 400, "not valid JSON"),
    ("not_object", "POST", G, [1, 2], 400, "JSON object"),
    ("empty_body", "POST", G, b"", 400, "empty request body"),
    ("missing_input_ids", "POST", G, {"sampling_params": {}}, 400, "missing `input_ids`"),
    ("text_input", "POST", G, {"text": "hello"}, 400, "no tokenizer"),
    ("empty_input_ids", "POST", G, {"input_ids": []}, 400, "non-empty"),
    ("empty_prompt", "POST", G, {"input_ids": [[1], []]}, 400, "input_ids[1] is empty"),
    ("ids_not_list", "POST", G, {"input_ids": 5}, 400, "non-empty list"),
    ("out_of_vocab", "POST", G, {"input_ids": [1, 256]}, 400, "outside the vocabulary"),
    ("negative_id", "POST", G, {"input_ids": [[3], [-1]]}, 400, "input_ids[1][0] = -1"),
    ("float_id", "POST", G, {"input_ids": [1, 2.5]}, 400, "not an integer"),
    ("string_id", "POST", G, {"input_ids": ["a"]}, 400, "not an integer"),
    ("bool_id", "POST", G, {"input_ids": [True]}, 400, "not an integer"),
    ("too_long_prompt", "POST", G, {"input_ids": [1] * 600}, 400, "longest prompt"),
    ("prompt_plus_new_too_long", "POST", G,
     {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 100}}, 400,
     "max_position_embeddings"),
    ("unknown_sampling_key", "POST", G,
     {"input_ids": [1], "sampling_params": {"beam_width": 2}}, 400, "unsupported keys"),
    ("unsupported_sglang_value", "POST", G,
     {"input_ids": [1], "sampling_params": {"min_new_tokens": 3}}, 400, "min_new_tokens"),
    ("sampling_not_object", "POST", G, {"input_ids": [1], "sampling_params": 3}, 400,
     "must be an object"),
    ("negative_temperature", "POST", G,
     {"input_ids": [1], "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("string_temperature", "POST", G,
     {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 400, "temperature"),
    ("top_p_zero", "POST", G, {"input_ids": [1], "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ("top_p_big", "POST", G, {"input_ids": [1], "sampling_params": {"top_p": 1.5}}, 400,
     "top_p"),
    ("top_k_zero", "POST", G, {"input_ids": [1], "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ("max_new_zero", "POST", G, {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}},
     400, "max_new_tokens"),
    ("max_new_float", "POST", G,
     {"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}, 400, "max_new_tokens"),
    ("negative_seed", "POST", G, {"input_ids": [1], "sampling_params": {"sampling_seed": -1}},
     400, "sampling_seed"),
    ("huge_seed", "POST", G, {"input_ids": [1], "sampling_params": {"sampling_seed": 2**40}},
     400, "sampling_seed"),
    ("stop_ids_type", "POST", G, {"input_ids": [1], "sampling_params": {"stop_token_ids": "x"}},
     400, "stop_token_ids"),
    ("too_many_stop_ids", "POST", G,
     {"input_ids": [1], "sampling_params": {"stop_token_ids": list(range(9))}}, 400, "at most"),
    ("sampling_list_length", "POST", G,
     {"input_ids": [[1], [2]], "sampling_params": [{}]}, 400, "1 entries for 2 prompts"),
    ("sampling_list_single", "POST", G, {"input_ids": [1], "sampling_params": [{}]}, 400,
     "single prompt"),
    ("bad_return_logprob", "POST", G, {"input_ids": [1], "return_logprob": "yes"}, 400,
     "return_logprob"),
    ("bad_rid", "POST", G, {"input_ids": [1], "rid": 7}, 400, "rid"),
    ("stream_not_bool", "POST", G, {"input_ids": [1], "stream": "yes"}, 400, "stream"),
    ("unknown_field", "POST", G, {"input_ids": [1], "foo": 1}, 400, "unsupported /generate"),
    ("get_generate", "GET", G, None, 405, "use POST"),
    ("delete_health", "DELETE", "/health", None, 405, "use GET"),
    ("unknown_path", "GET", "/v2/nothing", None, 404, "unknown path"),
    ("update_no_path", "POST", "/update_weights_from_disk", {}, 400, "missing `model_path`"),
    ("update_unknown_field", "POST", "/update_weights_from_disk",
     {"model_path": "/x", "bogus": 1}, 400, "unsupported"),
]


@pytest.mark.parametrize("name,method,path,body,status,needle", BAD, ids=[c[0] for c in BAD])
def test_bad_request_gets_4xx_and_server_keeps_serving(server, name, method, path, body, status,
                                                       needle):
  raw = body if isinstance(body, bytes) else None
  got, obj = request(server.url, method, path, body=None if raw is not None else body, raw=raw)
  assert got == status, (name, obj)
  assert set(obj) == {"error"} and obj["error"]["type"], obj
  assert needle in obj["error"]["message"], obj
  assert request(server.url, "GET", "/health")[0] == 200


def test_transport_level_errors(server):
  # Body larger than the limit: refused from the header, without reading it.
  st, obj = request(server.url, "POST", G, raw=b"{}",
                    headers={"Content-Length": str(1 << 30)})
  assert st == 413 and "exceeds the limit" in obj["error"]["message"]
  st, obj = request(server.url, "POST", G, raw=b"{}", headers={"Content-Length": "abc"})
  assert st == 400 and "Content-Length" in obj["error"]["message"]
  # Not HTTP at all, and a POST without Content-Length: raw sockets.
  for raw, code in ((b"GET /a b HTTP/1.1\r\n\r\n", 400), (b"BREW / HTTP/1.1\r\n\r\n", 501),
                    (b"POST /generate HTTP/1.1\r\nHost: x\r\n\r\n", 411)):
    with socket.create_connection((server.host, server.port), timeout=30) as s:
      s.sendall(raw)
      chunks = []
      while chunk := s.recv(65536):  # the server closes the connection after an error
        chunks.append(chunk)
      head = b"".join(chunks).decode("latin-1")
    assert head.startswith("HTTP/1.") and f" {code} " in head.split("\r\n")[0], head
    assert '"error"' in head
  assert request(server.url, "GET", "/health")[0] == 200


# ------------------------------------------------------------------------------ generation

def test_generation_over_http(server, reference, engine, params0, tmp_path):
  """Every check that runs the model, in one test.

  pytest-xdist spreads a module's tests over its workers; keeping the generating checks in one
  test keeps the (slow, CPU) compilation in one process. Order matters: the weight update runs
  last (it restores the original weights at its end).
  """
  _check_shapes(server, reference)
  _check_seeds_and_stop_tokens(server)
  _check_32_concurrent_clients(server, reference)
  _check_api_key(engine)
  _check_update_weights_from_disk(server, params0, tmp_path)


def test_info_endpoints(server):
  st, info = request(server.url, "GET", "/get_model_info")
  assert st == 200 and info["is_generation"] is True
  assert info["policy"] == "fp4_trace" and info["weight_version"]
  if info["weight_version"] == "0":  # (the weight-update check may have run before)
    assert info["model_path"] == "random-init:tiny(seed=0)"
  assert info["config"]["vocab_size"] == CFG.vocab_size
  st, flushed = request(server.url, "POST", "/flush_cache")
  assert st == 200 and flushed["success"] is True
  st, g = request(server.url, "GET", "/trace/guidance")
  assert st == 200 and g["enabled"] and g["store"] == server.engine.store.root
  assert g["mode"] == "compact" and g["guided_layers"] == list(CFG.guided_layers)
  assert g["sites"] == ["moe_in", "expert_mid", "k", "v"]


def _check_shapes(server, reference):
  p = prompt(0, 6)
  sp = {"max_new_tokens": 5, "temperature": 0.0, "sampling_seed": 3}
  st, out = request(server.url, "POST", G, {"input_ids": p, "sampling_params": sp,
                                            "return_logprob": True, "rid": "req-a"})
  assert st == 200 and isinstance(out, dict), out
  meta = out["meta_info"]
  assert meta["id"] == "req-a" and meta["prompt_tokens"] == 6
  assert meta["completion_tokens"] == len(out["output_ids"]) == 5
  assert meta["finish_reason"] == {"type": "length", "length": 5}
  assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
  assert all(e[2] is None and e[0] <= 0 for e in meta["output_token_logprobs"])
  assert meta["weight_version"] == "0"
  tg = meta["trace_guidance"]
  assert tg["store"] == server.engine.store.root and tg["batch_id"] and tg["seq_id"]
  assert tg["guidance_bytes_per_token"] > 0
  ref = ref_generate(reference, [p], [SamplingParams.from_sglang(sp)])[0]
  assert out["output_ids"] == ref.tokens

  # Batched input -> a list, in order; per-request sampling params and return_logprob.
  body = {"input_ids": [prompt(1, 3), prompt(2, 16)],
          "sampling_params": [{"max_new_tokens": 2, "temperature": 0.0},
                              {"max_new_tokens": 16, "temperature": 0.0}],
          "return_logprob": [False, True]}
  st, outs = request(server.url, "POST", G, body)
  assert st == 200 and isinstance(outs, list) and len(outs) == 2
  assert len(outs[0]["output_ids"]) == 2 and "output_token_logprobs" not in outs[0]["meta_info"]
  assert len(outs[1]["meta_info"]["output_token_logprobs"]) == 16
  assert outs[0]["meta_info"]["id"] != outs[1]["meta_info"]["id"]

  # The guidance batch is durable (manifest written last) once the store flushes.
  server.engine.store.flush()
  assert os.path.exists(os.path.join(tg["store"], tg["batch_id"], "manifest.json"))
  st, g = request(server.url, "GET", "/trace/guidance")
  assert g["last_batch"]["guidance_batch_id"] == outs[1]["meta_info"]["trace_guidance"][
      "batch_id"]


def _check_seeds_and_stop_tokens(server):
  client = HttpRolloutEngine(server.url)
  p = prompt(3, 8)
  sampled = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in (7, 7, 8)]
  greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
  a, b, c, g = client.generate([p] * 4, sampled + [greedy])
  assert a.tokens == b.tokens and a.logprobs == b.logprobs  # same seed, same tokens
  assert a.tokens != c.tokens  # another seed (12 tokens over 256 ids: equal is ~impossible)
  # A stop token ends the request with finish_reason stop, the stop token included.
  k = max(i for i, t in enumerate(g.tokens) if g.tokens.index(t) == i)  # first time seen
  stop = g.tokens[k]
  st, out = request(server.url, "POST", G, {
      "input_ids": p, "return_logprob": True,
      "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop]}})
  assert out["output_ids"] == g.tokens[:k + 1]
  assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def _check_32_concurrent_clients(server, reference):
  n = 32
  prompts = [prompt(100 + i, 3 + i % 14) for i in range(n)]
  sampling = [SamplingParams(max_new_tokens=4 + i % 13, temperature=0.0, seed=1000 + i)
              for i in range(n)]
  before = server.stats()["batcher"]
  results: list[Any] = [None] * n
  barrier = threading.Barrier(n)

  def worker(i: int) -> None:
    try:
      client = HttpRolloutEngine(server.url, timeout=300)
      barrier.wait(60)
      results[i] = client.generate([prompts[i]], sampling[i])[0]
    except BaseException as e:  # reported below
      results[i] = e

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(300)
  errors = [r for r in results if not isinstance(r, Sample)]
  assert not errors, errors[:3]
  after = server.stats()["batcher"]
  calls = after["engine_calls"] - before["engine_calls"]
  assert after["prompts"] - before["prompts"] == n
  assert calls < n, f"{calls} engine calls for {n} requests: not batched"
  assert after["max_batch_seen"] > 1

  ref = ref_generate(reference, prompts, sampling)
  for i, (got, want) in enumerate(zip(results, ref)):
    assert got.prompt == prompts[i]
    assert got.tokens == want.tokens, i
    assert got.finish_reason == want.finish_reason == "length"
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ auth

def _check_api_key(engine):
  opts = ServerOptions(max_batch=ROWS, pad_batch_to=ROWS, api_key="s3cret")
  with RolloutServer(engine, opts) as srv:
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    st, obj = request(srv.url, "POST", G, body)
    assert st == 401 and "missing API key" in obj["error"]["message"]
    st, obj = request(srv.url, "GET", "/get_model_info", headers={"Authorization": "Bearer no"})
    assert st == 401 and obj["error"]["type"] == "authentication_error"
    assert request(srv.url, "GET", "/health")[0] == 200  # liveness probes need no key
    ok = {"Authorization": "Bearer s3cret"}
    assert request(srv.url, "GET", "/get_model_info", headers=ok)[0] == 200
    with pytest.raises(RolloutHTTPError) as e:
      HttpRolloutEngine(srv.url).generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert e.value.status == 401 and "API key" in e.value.message
    (s,) = HttpRolloutEngine(srv.url, api_key="s3cret").generate(
        [[1, 2]], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert len(s.tokens) == 2


# ------------------------------------------------------------------------------ weights

def _check_update_weights_from_disk(server, params0, tmp_path):
  client = HttpRolloutEngine(server.url)
  prompts = [prompt(200 + i, 5 + 3 * i) for i in range(4)]
  sampling = [SamplingParams(max_new_tokens=10, temperature=0.0, seed=i) for i in range(4)]
  old = client.generate(prompts, sampling)

  params1 = model_lib.init_params(CFG, 1)
  hf.save_hf_checkpoint(str(tmp_path / "w1"), CFG, params1)
  hf.save_hf_checkpoint(str(tmp_path / "w0"), CFG, params0)
  # The checkpoint round trip is bit-exact, so the engine's in-forward NVFP4 quantization gives
  # the trainer's weight codes.
  _, loaded = hf.load_hf_checkpoint(str(tmp_path / "w1"))
  for x, y in zip(hf.flatten_params(params1).values(), hf.flatten_params(loaded).values()):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()

  client.update_weights(tmp_path / "w1", weight_version="step-1")
  new = client.generate(prompts, sampling)
  want = ref_generate(ref_engine(params1), prompts, sampling)
  for got, exp in zip(new, want):
    assert got.tokens == exp.tokens and got.logprobs == exp.logprobs
    assert got.meta["weight_version"] == "step-1"
  assert [s.tokens for s in new] != [s.tokens for s in old]
  info = client.model_info()
  assert info["weight_version"] == "step-1" and info["model_path"] == str(tmp_path / "w1")

  # A failed update is a 400 with the reason, and the served weights do not change.
  with pytest.raises(RolloutHTTPError) as e:
    client.update_weights(tmp_path / "missing")
  assert e.value.status == 400 and "missing" in e.value.message
  assert [s.tokens for s in client.generate(prompts, sampling)] == [s.tokens for s in new]
  with pytest.raises(TypeError):
    client.update_weights(params1)
  _check_weights_are_validated(client, tmp_path, prompts, sampling, new)

  # And back: the original weights give the original answers exactly.
  client.update_weights(str(tmp_path / "w0"))
  again = client.generate(prompts, sampling)
  assert [(s.tokens, s.logprobs) for s in again] == [(s.tokens, s.logprobs) for s in old]


def _hf_copy(src, dst, tensor_bytes=None, config=None):
  """A copy of the HF checkpoint `src` with one tensor's bytes all 0xFF (NaN in float32) and/or
  config.json fields replaced (both spellings)."""
  shutil.copytree(src, dst)
  if tensor_bytes is not None:
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[tensor_bytes].view(torch.uint8).fill_(0xFF)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  if config:
    d = json.loads((dst / "config.json").read_text())
    d.update(config)
    for key, alias in (("rope_theta", "rope_parameters"), ("dtype", "torch_dtype")):
      if key in config:
        if alias == "rope_parameters":
          d[alias]["rope_theta"] = config[key]
        else:
          d[alias] = config[key]
    (dst / "config.json").write_text(json.dumps(d))
  return dst


WRONG_CONFIGS = [("rope_theta", 5e5), ("rms_norm_eps", 1e-5), ("norm_topk_prob", False),
                 ("dtype", "bfloat16")]


def _check_weights_are_validated(client, tmp_path, prompts, sampling, served):
  """Weights are validated, not just shaped: a checkpoint with a tensor of 0xFF bytes (NaN),
  or whose config.json differs in a field that changes the computation, is a 400 naming the
  tensor or field, and the served weights, version and model path do not change."""
  before = client.model_info()
  name = "model.layers.0.mlp.experts.2.down_proj.weight"
  with pytest.raises(RolloutHTTPError) as e:
    client.update_weights(_hf_copy(tmp_path / "w1", tmp_path / "nan", tensor_bytes=name))
  assert e.value.status == 400 and f"tensor {name} holds non-finite values" in e.value.message
  for field, value in WRONG_CONFIGS:
    with pytest.raises(RolloutHTTPError) as e:
      client.update_weights(_hf_copy(tmp_path / "w1", tmp_path / f"cfg_{field}",
                                     config={field: value}))
    assert e.value.status == 400 and f"differs from the served model's in {field}" in \
        e.value.message, e.value.message
  after = client.model_info()
  assert (after["model_path"], after["weight_version"]) == (before["model_path"],
                                                            before["weight_version"])
  assert [(s.tokens, s.logprobs) for s in client.generate(prompts, sampling)] == [
      (s.tokens, s.logprobs) for s in served]


# ------------------------------------------------------------------------------ batcher

class _StubEngine:
  """Records each call's batch; prompts containing 13 make a call fail."""

  def __init__(self, delay_s: float = 0.05):
    self.calls: list[int] = []
    self.delay_s = delay_s

  def generate(self, prompts, sampling):
    self.calls.append(len(prompts))
    time.sleep(self.delay_s)
    if any(13 in p for p in prompts):
      raise ValueError("token 13 is cursed")
    return [Sample(list(p), [sum(p) % 97] * s.max_new_tokens, [-1.0] * s.max_new_tokens,
                   "length") for p, s in zip(prompts, sampling)]


def test_batcher_collects_splits_pads_and_isolates_failures():
  eng = _StubEngine()
  b = Batcher(eng, max_batch=4, window_s=0.05, pad_to=8).start()
  sp = SamplingParams(max_new_tokens=2)
  try:
    jobs = [b.submit([[i, i + 1]], [sp]) for i in range(3)]
    big = b.submit([[k] for k in range(6)], [sp] * 6)  # more than max_batch: split
    for i, j in enumerate(jobs):
      assert j.wait(10)[0].tokens == [(2 * i + 1) % 97] * 2
    assert [s.prompt for s in big.wait(10)] == [[k] for k in range(6)]
    assert all(c == 8 for c in eng.calls)  # padded to a fixed shape
    assert len(eng.calls) < 4
    st = b.stats()
    assert st["prompts"] == 9 and st["max_batch_seen"] == 4 and st["padded_rows"] > 0

    # A failing request in a shared batch fails alone: the others are rerun and answered.
    bad = b.submit([[13]], [sp])
    good = b.submit([[5]], [sp])
    assert good.wait(10)[0].tokens == [5, 5]
    with pytest.raises(ValueError, match="cursed"):
      bad.wait(10)
  finally:
    b.stop()
  with pytest.raises(BatcherClosed):
    b.submit([[1]], [sp])


# ------------------------------------------------------------------------------ serve.py

def test_serve_config_file(tmp_path):
  cfg_file = tmp_path / "cfg.py"
  cfg_file.write_text(
      "import ml_collections\n"
      "def get_config():\n"
      "  c = ml_collections.ConfigDict()\n"
      "  c.model = {'preset': 'tiny', 'num_hidden_layers': 2}\n"
      "  c.policy = 'fp4_rtn'\n"
      "  c.seed = 3\n"
      "  c.server = {'port': 0, 'max_batch': 8, 'batch_window_ms': 5.0}\n"
      "  return c\n")
  cfg = serve.load_config(str(cfg_file))
  assert cfg["policy"] == "fp4_rtn" and cfg["server"]["max_batch"] == 8
  assert cfg["server"]["host"] == "127.0.0.1"  # defaults kept
  mc = serve.model_config(cfg)
  assert mc.policy == "fp4_rtn" and mc.vocab_size == CFG.vocab_size
  opts = serve.server_options(cfg, "x")
  assert opts.max_batch == 8 and opts.batch_window_s == pytest.approx(0.005)
  default = serve.load_config(None)
  assert serve.model_config(default) == CFG  # the default: tiny, fp4_trace
  assert serve.server_options(default, "x").pad_batch_to == default["server"]["max_batch"]
  own = {**default, "model": {"preset": "tiny", "policy": "bf16"}}
  assert serve.model_config(own).policy == "bf16"  # the model's policy unless one is set
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config():\n  return {'modle': 'tiny'}\n")
  with pytest.raises(ValueError, match="unknown keys"):
    serve.load_config(str(bad))

  # A guidance dir that already holds batches: the ids continue after them.
  gdir = tmp_path / "guidance"
  (gdir / "b000004").mkdir(parents=True)
  eng, path = serve.build_engine(default, str(gdir))
  assert path == "random-init:tiny(seed=0)" and isinstance(eng, InProcessEngine)
  assert eng.store.new_batch_id() == "b000005" and eng.store.root == str(gdir)
  eng.close()
  eng.store.close()
