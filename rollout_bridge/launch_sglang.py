"""Starts an SGLang 0.5.23 server for FP4 rollout, waits for /health, and stops it.

    python -m rollout_bridge.launch_sglang --model_path=CKPT [--port=30000] [--dry_run]

Quantization (`--quantization`, default `auto`): a BF16 checkpoint is served with this project's
plugin method `trace_nvfp4` (NVFP4 experts with FP4 activations emulated on Hopper, NVFP4 KV
emulation, optional guidance recording; see `rollout_bridge/sglang_plugin`); a ModelOpt NVFP4
checkpoint (`save_nvfp4_checkpoint`) with SGLang's own `modelopt_fp4` (weight-only Marlin on
SM80-SM90). The plugin reaches SGLang's processes only through its `sglang.srt.plugins` entry
point, so `trace_nvfp4` needs the package installed (`pip install -e .`); the launcher checks.

For `trace_nvfp4` the command line also gets:
- `--ep-size` equal to `--tp-size`: expert tensor parallelism would change NVFP4 scales;
- CUDA graphs off (`--cuda-graph-backend-{decode,prefill} disabled`, 0.5.23's spelling of
  `--disable-cuda-graph`): the emulation reads expert row counts on the host and the torch
  twin copies its E2M1 grid to the device per call, neither of which graph capture allows;
- the plugin's options in the environment variable `TRACE_NVFP4_CONFIG` (guided layers default
  to the deepest half of the checkpoint's layers);
- with `record_guidance`, `--disable-radix-cache`: a prefix served from SGLang's radix cache is
  not recomputed, so its tokens would have no guidance rows.
`--skip-tokenizer-init` is added when the checkpoint has no tokenizer files (the RL client sends
`input_ids`). The server binds 127.0.0.1 unless told otherwise.

`SGLangServer` is the process manager (a context manager): the server runs in its own process
group with its output in a log file; `stop()` sends SIGTERM to the group, then SIGKILL after a
grace period.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from absl import flags

from rollout_bridge.sglang_plugin import options as trace_opts

PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_ENTRY = "rollout_bridge.sglang_plugin:register"
TRACE = "trace_nvfp4"
MODELOPT = "modelopt_fp4"
QUANTIZATIONS = ("auto", TRACE, MODELOPT, "none")
KV_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16", "mxfp8")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "spiece.model")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """What to serve and how. None fields are decided from the checkpoint (see `resolve`)."""
  model_path: str
  quantization: str = "auto"
  kv_cache_dtype: str = "auto"
  mem_fraction_static: float | None = None
  port: int = 30000
  host: str = "127.0.0.1"
  tp_size: int = 1
  ep_size: int | None = None
  dtype: str | None = None
  skip_tokenizer_init: bool | None = None
  disable_cuda_graph: bool | None = None
  record_guidance: bool = False
  trace_options: trace_opts.TraceOptions | None = None
  api_key: str | None = None
  random_seed: int | None = None
  extra_args: tuple[str, ...] = ()
  python: str = sys.executable

  def __post_init__(self):
    if self.quantization not in QUANTIZATIONS:
      raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
    if self.kv_cache_dtype not in KV_DTYPES:
      raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}")
    if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
      raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
    if not 0 < self.port < 65536:
      raise ValueError(f"port must be in 1..65535, got {self.port}")

  @property
  def url(self) -> str:
    host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
    return f"http://{host}:{self.port}"


# ------------------------------------------------------------------------------ checkpoint


def read_checkpoint_config(model_path: str) -> dict[str, Any]:
  """config.json of a local checkpoint ({} for a hub id or a directory without one)."""
  path = os.path.join(model_path, "config.json")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def is_modelopt_nvfp4(model_path: str, hf_config: Mapping[str, Any] | None = None) -> bool:
  """Whether the checkpoint is ModelOpt NVFP4 (config.json or hf_quant_config.json says so)."""
  hf_config = read_checkpoint_config(model_path) if hf_config is None else hf_config
  qc = hf_config.get("quantization_config") or {}
  algo = str(qc.get("quant_algo", ""))
  legacy = os.path.join(model_path, "hf_quant_config.json")
  if not algo and os.path.isfile(legacy):
    with open(legacy) as f:
      algo = str((json.load(f).get("quantization") or {}).get("quant_algo", ""))
  return "NVFP4" in algo.upper()


def has_tokenizer(model_path: str) -> bool:
  return any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES)


def plugin_installed() -> bool:
  """Whether the `trace_nvfp4` entry point is installed (setup.cfg, `pip install -e .`)."""
  from importlib.metadata import entry_points
  return any(ep.value.replace(" ", "") == PLUGIN_ENTRY for ep in entry_points(group=PLUGIN_GROUP))


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A ServerConfig with every automatic choice made."""
  config: ServerConfig
  quantization: str | None
  skip_tokenizer_init: bool
  disable_cuda_graph: bool
  ep_size: int | None
  trace_options: trace_opts.TraceOptions | None
  disable_radix_cache: bool


def resolve(cfg: ServerConfig) -> Resolved:
  """Decides quantization, tokenizer, CUDA graphs, EP size and plugin options from the
  checkpoint. Pure except for reading the checkpoint's json files."""
  hf = read_checkpoint_config(cfg.model_path)
  modelopt = is_modelopt_nvfp4(cfg.model_path, hf)
  quant = cfg.quantization
  if quant == "auto":
    quant = MODELOPT if modelopt else TRACE
  if quant == TRACE and modelopt:
    raise ValueError(f"{cfg.model_path} is a ModelOpt NVFP4 checkpoint; serve it with "
                     f"quantization={MODELOPT} ({TRACE} quantizes BF16 master weights itself)")
  if quant == "none":
    quant = None
  options = None
  if quant == TRACE:
    if cfg.kv_cache_dtype not in ("auto", "bf16", "bfloat16"):
      raise ValueError(f"{TRACE} emulates the NVFP4 KV cache itself (TraceOptions.kv_cache) and "
                       f"needs a BF16 cache; got kv_cache_dtype={cfg.kv_cache_dtype!r}")
    base = cfg.trace_options or trace_opts.TraceOptions()
    changes: dict[str, Any] = {}
    if base.num_layers is None and "num_hidden_layers" in hf:
      changes["num_layers"] = int(hf["num_hidden_layers"])
    if cfg.record_guidance and cfg.tp_size != 1:
      raise ValueError("record_guidance runs on one GPU (tp_size=1): ranks' guidance records "
                       "(local expert ids, head shards of K/V) are not merged")
    if cfg.record_guidance and not base.record_capacity:
      changes["record_capacity"] = 16384
    if not cfg.record_guidance and base.record_capacity:
      changes["record_capacity"] = 0
    options = dataclasses.replace(base, **changes)
  skip = cfg.skip_tokenizer_init
  if skip is None:
    skip = not has_tokenizer(cfg.model_path) if os.path.isdir(cfg.model_path) else False
  no_graph = cfg.disable_cuda_graph
  if no_graph is None:
    no_graph = quant == TRACE
  ep = cfg.ep_size
  if ep is None and quant == TRACE and cfg.tp_size > 1:
    ep = cfg.tp_size
  recording = options is not None and options.record_capacity > 0
  return Resolved(cfg, quant, skip, no_graph, ep, options, recording)


# ------------------------------------------------------------------------------ command line


def build_command(cfg: ServerConfig | Resolved) -> list[str]:
  """The `python -m sglang.launch_server ...` argv for cfg (no side effects)."""
  r = cfg if isinstance(cfg, Resolved) else resolve(cfg)
  c = r.config
  cmd = [c.python, "-m", "sglang.launch_server", "--model-path", c.model_path,
         "--host", c.host, "--port", str(c.port)]
  if r.quantization:
    cmd += ["--quantization", r.quantization]
  cmd += ["--kv-cache-dtype", c.kv_cache_dtype]
  if c.mem_fraction_static is not None:
    cmd += ["--mem-fraction-static", f"{c.mem_fraction_static:g}"]
  if c.tp_size != 1:
    cmd += ["--tp-size", str(c.tp_size)]
  if r.ep_size is not None:
    cmd += ["--ep-size", str(r.ep_size)]
  if c.dtype:
    cmd += ["--dtype", c.dtype]
  if r.skip_tokenizer_init:
    cmd += ["--skip-tokenizer-init"]
  if r.disable_cuda_graph:
    cmd += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
  if r.disable_radix_cache:
    cmd += ["--disable-radix-cache"]
  if c.api_key:
    cmd += ["--api-key", c.api_key]
  if c.random_seed is not None:
    cmd += ["--random-seed", str(c.random_seed)]
  return cmd + list(c.extra_args)


def build_env(cfg: ServerConfig | Resolved, base: Mapping[str, str] | None = None
              ) -> dict[str, str]:
  """The server's environment: base (default os.environ) plus the plugin's options."""
  r = cfg if isinstance(cfg, Resolved) else resolve(cfg)
  env = dict(os.environ if base is None else base)
  if r.trace_options is not None:
    env[trace_opts.ENV_VAR] = r.trace_options.to_env()
    allowed = env.get("SGLANG_PLUGINS", "")
    if allowed and TRACE not in {p.strip() for p in allowed.split(",")}:
      env["SGLANG_PLUGINS"] = f"{allowed},{TRACE}"
  return env


# ------------------------------------------------------------------------------ process


class ServerError(RuntimeError):
  """The server exited, or did not become healthy in time (message ends with its log tail)."""


class SGLangServer:
  """A server process: `start()`, `wait_healthy()`, `stop()`; `with` does all three.

  command: argv to run; url: base URL whose /health answers 200 once ready; env: process
  environment; log_path: file for the server's stdout/stderr (default: a temporary file).
  """

  def __init__(self, command: Sequence[str], url: str, env: Mapping[str, str] | None = None,
               log_path: str | None = None, api_key: str | None = None,
               health_timeout: float = 900.0, stop_timeout: float = 30.0):
    self.command = list(command)
    self.url = url.rstrip("/")
    self.env = dict(env) if env is not None else None
    self.log_path = log_path
    self.api_key = api_key
    self.health_timeout = health_timeout
    self.stop_timeout = stop_timeout
    self.proc: subprocess.Popen | None = None
    self._log = None

  @classmethod
  def from_config(cls, cfg: ServerConfig, **kwargs: Any) -> SGLangServer:
    r = resolve(cfg)
    if r.quantization == TRACE and not plugin_installed():
      raise RuntimeError(f"quantization={TRACE} needs the plugin entry point "
                         f"'{PLUGIN_ENTRY}' in group '{PLUGIN_GROUP}' (setup.cfg "
                         "[options.entry_points]); reinstall the package: pip install -e .")
    return cls(build_command(r), cfg.url, env=build_env(r), api_key=cfg.api_key, **kwargs)

  def start(self) -> SGLangServer:
    if self.proc is not None:
      raise RuntimeError("server already started")
    if self.log_path is None:
      fd, self.log_path = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
      os.close(fd)
    self._log = open(self.log_path, "ab")
    # Own session: stop() signals the whole group (SGLang forks scheduler/detokenizer children).
    self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
    return self

  def healthy(self, timeout: float = 5.0) -> bool:
    """One GET /health: True on HTTP 200."""
    req = urllib.request.Request(self.url + "/health")
    if self.api_key:
      req.add_header("Authorization", f"Bearer {self.api_key}")
    try:
      with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
      return False

  def wait_healthy(self, timeout: float | None = None, poll: float = 0.5) -> None:
    """Polls /health until 200; raises ServerError if the process exits or time runs out."""
    if self.proc is None:
      raise RuntimeError("server not started")
    deadline = time.monotonic() + (self.health_timeout if timeout is None else timeout)
    while True:
      code = self.proc.poll()
      if code is not None:
        raise ServerError(f"server exited with code {code} before becoming healthy"
                          f"{self._tail()}")
      if self.healthy(timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
        return
      if time.monotonic() >= deadline:
        raise ServerError(f"server not healthy at {self.url}/health after "
                          f"{self.health_timeout if timeout is None else timeout:g} s"
                          f"{self._tail()}")
      time.sleep(poll)

  def stop(self) -> int | None:
    """SIGTERM to the server's process group, SIGKILL after stop_timeout; returns exit code."""
    proc, self.proc = self.proc, None
    if proc is None:
      return None
    try:
      if proc.poll() is None:
        self._signal_group(proc, signal.SIGTERM)
        try:
          proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
          self._signal_group(proc, signal.SIGKILL)
          proc.wait(self.stop_timeout)
      # Children left behind by a leader that exited on its own.
      self._signal_group(proc, signal.SIGKILL)
      return proc.returncode
    finally:
      if self._log is not None:
        self._log.close()
        self._log = None

  @staticmethod
  def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
      os.killpg(proc.pid, sig)  # the group of the process we started (start_new_session)
    except (ProcessLookupError, PermissionError):
      pass

  def _tail(self, n: int = 4000) -> str:
    if not self.log_path or not os.path.isfile(self.log_path):
      return ""
    with open(self.log_path, "rb") as f:
      f.seek(max(0, os.path.getsize(self.log_path) - n))
      text = f.read().decode(errors="replace")
    return f"; log {self.log_path} ends with:\n{text}"

  def __enter__(self) -> SGLangServer:
    self.start()
    try:
      self.wait_healthy()
    except BaseException:
      self.stop()
      raise
    return self

  def __exit__(self, *exc: Any) -> None:
    self.stop()


def launch(cfg: ServerConfig, **kwargs: Any) -> SGLangServer:
  """An unstarted SGLangServer for cfg (use it as a context manager)."""
  return SGLangServer.from_config(cfg, **kwargs)


# ------------------------------------------------------------------------------ CLI

FLAGS = flags.FlagValues()
flags.DEFINE_string("model_path", None, "Checkpoint directory (HF safetensors: BF16, or ModelOpt "
                    "NVFP4 from save_nvfp4_checkpoint).", flag_values=FLAGS)
flags.DEFINE_enum("quantization", "auto", list(QUANTIZATIONS), "auto: trace_nvfp4 for BF16 "
                  "checkpoints, modelopt_fp4 for ModelOpt NVFP4 ones.", flag_values=FLAGS)
flags.DEFINE_enum("kv_cache_dtype", "auto", list(KV_DTYPES), "SGLang KV cache dtype (trace_nvfp4 "
                  "emulates NVFP4 KV in a BF16 cache: keep auto).", flag_values=FLAGS)
flags.DEFINE_float("mem_fraction_static", None, "SGLang --mem-fraction-static.",
                   flag_values=FLAGS)
flags.DEFINE_string("host", "127.0.0.1", "Bind address.", flag_values=FLAGS)
flags.DEFINE_integer("port", 30000, "HTTP port.", flag_values=FLAGS)
flags.DEFINE_integer("tp_size", 1, "Tensor parallel size (GPUs).", flag_values=FLAGS)
flags.DEFINE_integer("ep_size", None, "Expert parallel size (default: tp_size for trace_nvfp4).",
                     flag_values=FLAGS)
flags.DEFINE_bool("record_guidance", False, "Record TRACE guidance in the plugin.",
                  flag_values=FLAGS)
flags.DEFINE_list("guided_layers", None, "Guided layers (default: the deepest half).",
                  flag_values=FLAGS)
flags.DEFINE_enum("guidance_mode", "compact", ["compact", "full"], "Guidance record mode.",
                  flag_values=FLAGS)
flags.DEFINE_integer("record_capacity", 16384, "Token rows preallocated per guided site.",
                     flag_values=FLAGS)
flags.DEFINE_enum("kv_emulation", "nvfp4", ["nvfp4", "none"], "trace_nvfp4: NVFP4 KV emulation.",
                  flag_values=FLAGS)
flags.DEFINE_string("api_key", None, "Server API key.", flag_values=FLAGS)
flags.DEFINE_float("health_timeout", 900.0, "Seconds to wait for /health.", flag_values=FLAGS)
flags.DEFINE_string("log_file", None, "Server log file (default: a temporary file).",
                    flag_values=FLAGS)
flags.DEFINE_bool("dry_run", False, "Print the command line and environment, start nothing.",
                  flag_values=FLAGS)
flags.DEFINE_list("extra_args", [], "More SGLang arguments, comma separated.", flag_values=FLAGS)


def config_from_flags(fv: flags.FlagValues = FLAGS) -> ServerConfig:
  opts = trace_opts.TraceOptions(
      guidance_mode=fv.guidance_mode,
      guided_layers=None if fv.guided_layers is None else tuple(int(i) for i in fv.guided_layers),
      record_capacity=fv.record_capacity if fv.record_guidance else 0,
      kv_cache=fv.kv_emulation)
  return ServerConfig(model_path=fv.model_path, quantization=fv.quantization,
                      kv_cache_dtype=fv.kv_cache_dtype,
                      mem_fraction_static=fv.mem_fraction_static, port=fv.port, host=fv.host,
                      tp_size=fv.tp_size, ep_size=fv.ep_size, record_guidance=fv.record_guidance,
                      trace_options=opts, api_key=fv.api_key, extra_args=tuple(fv.extra_args))


def _interrupt(signum: int, frame: Any) -> None:
  raise KeyboardInterrupt


def main(argv: Sequence[str]) -> int:
  """Parses flags (argv[0] is the program); serves until interrupted, or prints (--dry_run)."""
  argv = list(argv) if argv else ["launch_sglang"]
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(FLAGS.get_help())
    return 0
  FLAGS.unparse_flags()
  FLAGS(argv)
  if not FLAGS.model_path:
    raise SystemExit("launch_sglang: --model_path is required")
  cfg = config_from_flags()
  r = resolve(cfg)
  if FLAGS.dry_run:
    print(" ".join(build_command(r)))
    env = build_env(r, base={})
    for k, v in sorted(env.items()):
      print(f"{k}={v}")
    return 0
  server = launch(cfg, log_path=FLAGS.log_file, health_timeout=FLAGS.health_timeout)
  signal.signal(signal.SIGTERM, _interrupt)  # `kill` of the launcher also stops the server
  with server:
    print(f"SGLang serving {cfg.model_path} at {cfg.url} (log {server.log_path})", flush=True)
    try:
      while server.proc is not None and server.proc.poll() is None:
        time.sleep(1.0)
    except KeyboardInterrupt:
      pass
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
