"""Serve the embedded rollout engine over SGLang's native HTTP API (`rollout_bridge.server`).

  python -m rollout_bridge.serve --port=30000
  python -m rollout_bridge.serve --port=30000 --config=path/to/config.py \
      --guidance_dir=/tmp/guidance --api_key_file=/run/secrets/rollout_key

With no flag but --port it serves the tiny CPU model (`trace_jax.model.tiny()`, policy
`fp4_trace`, random weights from seed 0) on 127.0.0.1. A config file defines `get_config()`
returning an ml_collections ConfigDict (or a dict) with any of:

  model:      a preset name ("tiny", "qwen3_30b_a3b") or a dict {"preset": name, **ModelConfig
              field overrides}
  policy:     precision policy (default: model.policy, else "fp4_trace"); guided_layers and
              guidance_mode likewise override the model's
  checkpoint: an HF safetensors directory (`save_hf_checkpoint`) to serve instead of a random
              init; its config.json fixes the shapes and the compute dtype
  seed:       random-init seed (default 0)
  server:     {max_batch, batch_window_ms, pad_batch, max_prompt_len, max_new_tokens_limit,
              max_body_mb, request_timeout_s, api_key, guidance_dir, host, port}

pad_batch (default true) pads every engine call to max_batch rows: one compiled program per
(prompt, new-token) length bucket instead of one per power-of-two batch size as well.

Command-line flags override the config file.

API key (required as `Authorization: Bearer <key>` on every path but /health), the first set of:
--api_key_file (the file's content, surrounding whitespace stripped) or --api_key (not both),
the environment variable TRACE_API_KEY, the config's server.api_key. Prefer the file or the
variable: a --api_key value is visible to every local user in `ps`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from absl import flags

from rollout_bridge.client import API_KEY_ENV, resolve_api_key
from rollout_bridge.server import RolloutServer, ServerOptions
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.train import run_guard

log = logging.getLogger("rollout_bridge.serve")

FLAGS = flags.FlagValues()  # private: importing this module never touches absl's global FLAGS
flags.DEFINE_integer("port", None, "Port to listen on (0: any free port).", flag_values=FLAGS)
flags.DEFINE_string("host", None, "Address to bind (default 127.0.0.1; 0.0.0.0 exposes the "
                    "server to the network: set an API key).", flag_values=FLAGS)
flags.DEFINE_string("config", None, "Config .py with get_config() (see the module docstring).",
                    flag_values=FLAGS)
flags.DEFINE_string("api_key", None, "Require `Authorization: Bearer <key>` (all but /health). "
                    "Visible in `ps`: prefer --api_key_file or $TRACE_API_KEY.",
                    flag_values=FLAGS)
flags.DEFINE_string("api_key_file", None, "Read the API key from this file (whitespace "
                    "stripped).", flag_values=FLAGS)
flags.DEFINE_string("guidance_dir", None, "Write each batch's guidance here (TensorStore); the "
                    "responses say where.", flag_values=FLAGS)
flags.DEFINE_integer("max_batch", None, "Most prompts per engine call (default 32).",
                     flag_values=FLAGS)
flags.DEFINE_float("batch_window_ms", None, "How long to collect requests into a batch "
                   "(default 10 ms).", flag_values=FLAGS)
flags.DEFINE_bool("pad_batch", None, "Pad every engine call to max_batch rows, so only one "
                  "batch shape is compiled (default true; --nopad_batch: power-of-two buckets).",
                  flag_values=FLAGS)
flags.DEFINE_bool("warmup", False, "Compile before listening (one dummy batch).",
                  flag_values=FLAGS)

DEFAULTS: dict[str, Any] = {
    "model": "tiny", "policy": None, "guided_layers": None, "guidance_mode": None,
    "checkpoint": None, "seed": 0,
    "server": {"host": "127.0.0.1", "port": 30000, "max_batch": 32, "batch_window_ms": 10.0,
               "pad_batch": True, "max_prompt_len": None, "max_new_tokens_limit": None,
               "max_body_mb": 16, "request_timeout_s": 600.0, "api_key": None,
               "guidance_dir": None},
}
DEFAULT_POLICY = "fp4_trace"
LOCK = "server.lock"  # in --guidance_dir, held while the server runs


def _plain(x: Any) -> Any:
  """ConfigDict / FrozenConfigDict / nested mappings -> plain dicts."""
  if hasattr(x, "to_dict"):
    x = x.to_dict()
  if isinstance(x, dict):
    return {k: _plain(v) for k, v in x.items()}
  return x


def load_config(path: str | None) -> dict[str, Any]:
  """DEFAULTS updated with `get_config()` of the file at `path` (None: the defaults)."""
  cfg = {**DEFAULTS, "server": dict(DEFAULTS["server"])}
  if path is None:
    return cfg
  spec = importlib.util.spec_from_file_location("rollout_serve_config", path)
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot load config file {path}")
  mod = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(mod)
  except OSError as e:
    raise ValueError(f"--config={path}: cannot load the config file: {e.strerror}") from e
  if not hasattr(mod, "get_config"):
    raise ValueError(f"config file {path} defines no get_config()")
  user = _plain(mod.get_config())
  if not isinstance(user, dict):
    raise ValueError(f"get_config() in {path} must return a ConfigDict or dict")
  unknown = sorted(set(user) - set(DEFAULTS))
  if unknown:
    raise ValueError(f"config {path}: unknown keys {unknown}; known: {sorted(DEFAULTS)}")
  server = user.pop("server", None) or {}
  bad = sorted(set(server) - set(DEFAULTS["server"]))
  if bad:
    raise ValueError(f"config {path}: unknown server keys {bad}; known: "
                     f"{sorted(DEFAULTS['server'])}")
  cfg.update(user)
  cfg["server"].update(server)
  return cfg


def check_server(cfg: dict[str, Any]) -> None:
  """Raises ValueError naming every `server` setting out of range (before the engine is
  built): a port outside 0..65535, no batch room, a negative window or limit."""
  s, errors = cfg["server"], []

  def need(key: str, ok: Any, what: str, optional: bool = False) -> None:
    v = s.get(key)
    if optional and v is None:
      return
    num = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not (num and ok(v)):
      name = f"--{key}" if key in FLAGS and FLAGS[key].present else f"server.{key}"
      errors.append(f"{name} must be {what}, got {v!r}")

  need("port", lambda v: int(v) == v and 0 <= v <= 65535, "an int in 0..65535 (0: any free port)")
  need("max_batch", lambda v: int(v) == v and v >= 1, "an int >= 1")
  need("batch_window_ms", lambda v: 0 <= v < float("inf"), "a finite number >= 0")
  need("max_body_mb", lambda v: 0 < v < float("inf"), "a finite number > 0")
  need("request_timeout_s", lambda v: 0 < v < float("inf"), "a finite number > 0")
  for key in ("max_prompt_len", "max_new_tokens_limit"):
    need(key, lambda v: int(v) == v and v >= 1, "an int >= 1 or None", optional=True)
  if errors:
    raise ValueError("; ".join(errors))


def model_config(cfg: dict[str, Any]) -> Any:
  """The ModelConfig of a random-init model: the model section (`config.resolve`: a preset
  name or {"preset": name, **fields}) with the config's policy fields."""
  from trace_jax.model import config as config_lib
  fields = _policy_fields(cfg)
  if "policy" not in fields and not (isinstance(cfg["model"], dict) and "policy" in cfg["model"]):
    fields["policy"] = DEFAULT_POLICY
  return config_lib.resolve(cfg["model"], **fields)


def _policy_fields(cfg: dict[str, Any]) -> dict[str, Any]:
  out = {k: cfg[k] for k in ("policy", "guidance_mode") if cfg.get(k) is not None}
  if cfg.get("guided_layers") is not None:
    out["guided_layers"] = tuple(cfg["guided_layers"])
  return out


def build_engine(cfg: dict[str, Any], guidance_dir: str | None = None
                 ) -> tuple[InProcessEngine, str]:
  """(engine, model_path label) for a config dict from `load_config`."""
  if cfg.get("checkpoint"):
    from trace_jax.io import hf
    path = os.path.abspath(cfg["checkpoint"])
    config, params = hf.load_hf_checkpoint(path, **{"policy": DEFAULT_POLICY,
                                                    **_policy_fields(cfg)})
    model_path = path
  else:
    from trace_jax import model as model_lib
    config = model_config(cfg)
    params = model_lib.init_params(config, int(cfg.get("seed") or 0))
    preset = cfg["model"] if isinstance(cfg["model"], str) else (cfg["model"] or {}).get(
        "preset", "tiny")
    model_path = f"random-init:{preset}(seed={int(cfg.get('seed') or 0)})"
  store = None
  if guidance_dir:
    from trace_jax.guidance import store as guidance_store
    # A restarted server writing to the same directory continues the batch numbering there.
    store = guidance_store.GuidanceStore(guidance_dir, guidance_store.config_hash(config))
  max_batch = int(cfg["server"].get("max_batch") or 32)
  engine = InProcessEngine(params, config, guidance_store=store, max_batch=max(64, max_batch))
  return engine, model_path


def server_options(cfg: dict[str, Any], model_path: str) -> ServerOptions:
  s = cfg["server"]
  return ServerOptions(
      max_batch=int(s["max_batch"]), batch_window_s=float(s["batch_window_ms"]) / 1e3,
      pad_batch_to=int(s["max_batch"]) if s.get("pad_batch") else None,
      max_body_bytes=int(float(s["max_body_mb"]) * 2**20),
      max_prompt_len=s.get("max_prompt_len"), max_new_tokens_limit=s.get("max_new_tokens_limit"),
      request_timeout_s=float(s["request_timeout_s"]), api_key=s.get("api_key") or None,
      model_path=model_path,
      extra_info={"guidance_dir": s.get("guidance_dir"), "checkpoint": cfg.get("checkpoint")})


def build_server(cfg: dict[str, Any]) -> RolloutServer:
  """Engine + server (not yet serving) for a config dict; binds the socket."""
  s = cfg["server"]
  engine, model_path = build_engine(cfg, s.get("guidance_dir"))
  return RolloutServer(engine, server_options(cfg, model_path), host=s["host"],
                       port=int(s["port"]))


def _apply_flags(cfg: dict[str, Any]) -> dict[str, Any]:
  s = cfg["server"]
  for name, key in (("port", "port"), ("host", "host"),
                    ("guidance_dir", "guidance_dir"), ("max_batch", "max_batch"),
                    ("batch_window_ms", "batch_window_ms"), ("pad_batch", "pad_batch")):
    if FLAGS[name].value is not None:
      s[key] = FLAGS[name].value
  s["api_key"] = resolve_api_key(FLAGS.api_key, FLAGS.api_key_file, s.get("api_key"))
  return cfg


def _warmup(server: RolloutServer) -> None:
  from trace_jax.rollout.protocol import SamplingParams
  log.info("warming up (compiling the first batch shape)...")
  server.engine.generate([[0]], [SamplingParams(max_new_tokens=1, temperature=0.0, seed=0)])


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(__doc__)
    print(FLAGS.get_help())
    return 0
  FLAGS.unparse_flags()
  try:
    FLAGS(argv)
  except flags.Error as e:
    run_guard.fail(e, 2)
  logging.basicConfig(level=logging.INFO, force=True,  # replaces absl's root handler
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  with run_guard.exit_on_errors(), contextlib.ExitStack() as stack:
    with run_guard.user_input():
      cfg = _apply_flags(load_config(FLAGS.config))
      check_server(cfg)
    guidance_dir = cfg["server"].get("guidance_dir")
    if guidance_dir:  # one server writes a guidance directory (it numbers the batches there)
      stack.enter_context(run_guard.holding(os.path.join(guidance_dir, LOCK),
                                            f"the guidance directory {guidance_dir}"))
    server = build_server(cfg)
    if FLAGS.warmup:
      _warmup(server)
    return _serve(server)


def _serve(server: RolloutServer) -> int:
  """Serves until SIGTERM or Ctrl-C, then stops gracefully and flushes the guidance."""

  def _on_signal(signum: int, _frame: Any) -> None:
    log.info("signal %d: shutting down", signum)
    server.shutdown()  # graceful: in-flight requests finish (up to graceful_timeout_s)

  signal.signal(signal.SIGTERM, _on_signal)
  if not server.options.api_key and server.host not in ("127.0.0.1", "::1", "localhost"):
    log.warning("serving on %s without an API key: anyone who can reach it can generate and "
                "load weights (set --api_key_file or $%s)", server.host, API_KEY_ENV)
  log.info("serving %s (policy %s) on %s%s", server.options.model_path,
           server.engine.config.policy, server.url,
           " (API key required)" if server.options.api_key else "")
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.stop()
    try:
      server.engine.close()  # flushes pending guidance writes
      if server.engine.store is not None:
        server.engine.store.close()
    except Exception:
      log.exception("closing the engine failed (guidance writes may be incomplete)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
