"""`rollout_bridge.launch_sglang`: the SGLang command line per checkpoint and option (pure), and
process management (start, /health wait, stop) against a small fake HTTP server, no SGLang."""

from __future__ import annotations

import json
import signal
import socket
import sys
import time

import pytest

from rollout_bridge import launch_sglang as ls
from rollout_bridge.sglang_plugin import options as opts

# ------------------------------------------------------------------------------ checkpoints


def _ckpt(path, *, layers=4, modelopt=None, tokenizer=False):
  """A checkpoint directory with config.json (modelopt: 'config' or 'legacy' NVFP4 metadata)."""
  path.mkdir(parents=True, exist_ok=True)
  cfg = {"model_type": "qwen3_moe", "num_hidden_layers": layers}
  if modelopt == "config":
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                  "group_size": 16}
  (path / "config.json").write_text(json.dumps(cfg))
  if modelopt == "legacy":
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}))
  if tokenizer:
    (path / "tokenizer.json").write_text("{}")
  return str(path)


def _flag(cmd, name):
  return cmd[cmd.index(name) + 1] if name in cmd else None


def test_bf16_checkpoint_defaults(tmp_path):
  ckpt = _ckpt(tmp_path / "bf16")
  cfg = ls.ServerConfig(model_path=ckpt, python="python3")
  cmd = ls.build_command(cfg)
  assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
  assert _flag(cmd, "--model-path") == ckpt
  assert _flag(cmd, "--quantization") == "trace_nvfp4"
  assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "30000"
  assert _flag(cmd, "--kv-cache-dtype") == "auto"
  assert "--skip-tokenizer-init" in cmd                 # no tokenizer files
  assert _flag(cmd, "--cuda-graph-backend-decode") == "disabled"
  assert _flag(cmd, "--cuda-graph-backend-prefill") == "disabled"
  for absent in ("--ep-size", "--tp-size", "--mem-fraction-static", "--api-key",
                 "--disable-radix-cache"):
    assert absent not in cmd
  env = ls.build_env(cfg, base={"PATH": "/bin"})
  assert env["PATH"] == "/bin"
  o = opts.TraceOptions.from_mapping({}, env=env)
  assert (o.num_layers, o.guided, o.kv_cache, o.record_capacity) == (4, {2, 3}, "nvfp4", 0)


@pytest.mark.parametrize("tp, want_ep", [(1, None), (4, "4")])
def test_trace_nvfp4_options(tmp_path, tp, want_ep):
  ckpt = _ckpt(tmp_path / "ck", tokenizer=True)
  cfg = ls.ServerConfig(model_path=ckpt, quantization="trace_nvfp4", mem_fraction_static=0.75,
                        port=31234, host="0.0.0.0", tp_size=tp, record_guidance=tp == 1,
                        api_key="k", random_seed=7, extra_args=("--log-level", "info"),
                        trace_options=opts.TraceOptions(guided_layers=(3,),
                                                        guidance_mode="full"))
  cmd = ls.build_command(cfg)
  assert "--skip-tokenizer-init" not in cmd
  assert ("--disable-radix-cache" in cmd) == (tp == 1)
  assert _flag(cmd, "--mem-fraction-static") == "0.75"
  assert _flag(cmd, "--port") == "31234" and _flag(cmd, "--host") == "0.0.0.0"
  assert _flag(cmd, "--ep-size") == want_ep
  assert _flag(cmd, "--tp-size") == (None if tp == 1 else str(tp))
  assert _flag(cmd, "--api-key") == "k" and _flag(cmd, "--random-seed") == "7"
  assert cmd[-2:] == ["--log-level", "info"]
  assert cfg.url == "http://127.0.0.1:31234"
  env = json.loads(ls.build_env(cfg, base={})[opts.ENV_VAR])
  assert env == {"guidance_mode": "full", "guided_layers": [3], "keep_master": True,
                 "kv_cache": "nvfp4", "num_layers": 4,
                 "record_capacity": 16384 if tp == 1 else 0, "record_routing": True}


@pytest.mark.parametrize("layout", ["config", "legacy"])
def test_modelopt_checkpoint(tmp_path, layout):
  ckpt = _ckpt(tmp_path / "nvfp4", modelopt=layout)
  cfg = ls.ServerConfig(model_path=ckpt, kv_cache_dtype="fp8_e4m3")
  cmd = ls.build_command(cfg)
  assert _flag(cmd, "--quantization") == "modelopt_fp4"
  assert _flag(cmd, "--kv-cache-dtype") == "fp8_e4m3"
  assert "--cuda-graph-backend-decode" not in cmd and "--ep-size" not in cmd
  assert opts.ENV_VAR not in ls.build_env(cfg, base={})
  with pytest.raises(ValueError, match="modelopt_fp4"):
    ls.build_command(ls.ServerConfig(model_path=ckpt, quantization="trace_nvfp4"))


def test_no_quantization_and_overrides(tmp_path):
  ckpt = _ckpt(tmp_path / "ck")
  cmd = ls.build_command(ls.ServerConfig(model_path=ckpt, quantization="none",
                                         skip_tokenizer_init=False, disable_cuda_graph=False))
  assert "--quantization" not in cmd and "--skip-tokenizer-init" not in cmd
  assert "--cuda-graph-backend-decode" not in cmd
  # A hub id (not a local directory): no tokenizer check, no config.
  cmd = ls.build_command(ls.ServerConfig(model_path="Qwen/Qwen3-30B-A3B"))
  assert _flag(cmd, "--quantization") == "trace_nvfp4" and "--skip-tokenizer-init" not in cmd


def test_invalid_configs(tmp_path):
  ckpt = _ckpt(tmp_path / "ck")
  with pytest.raises(ValueError, match="BF16 cache"):
    ls.build_command(ls.ServerConfig(model_path=ckpt, kv_cache_dtype="nvfp4"))
  with pytest.raises(ValueError, match="quantization must be"):
    ls.ServerConfig(model_path=ckpt, quantization="fp4")
  with pytest.raises(ValueError, match="mem_fraction_static"):
    ls.ServerConfig(model_path=ckpt, mem_fraction_static=1.5)
  with pytest.raises(ValueError, match="port"):
    ls.ServerConfig(model_path=ckpt, port=0)
  with pytest.raises(ValueError, match="one GPU"):
    ls.build_command(ls.ServerConfig(model_path=ckpt, tp_size=2, record_guidance=True))


def test_plugin_whitelist_env(tmp_path):
  cfg = ls.ServerConfig(model_path=_ckpt(tmp_path / "ck"))
  assert ls.build_env(cfg, base={"SGLANG_PLUGINS": "other"})["SGLANG_PLUGINS"] == (
      "other,trace_nvfp4")
  assert "SGLANG_PLUGINS" not in ls.build_env(cfg, base={})


def test_from_config_requires_entry_point(tmp_path, monkeypatch):
  cfg = ls.ServerConfig(model_path=_ckpt(tmp_path / "ck"))
  monkeypatch.setattr(ls, "plugin_installed", lambda: False)
  with pytest.raises(RuntimeError, match="entry point"):
    ls.launch(cfg)
  monkeypatch.setattr(ls, "plugin_installed", lambda: True)
  server = ls.launch(cfg)
  assert server.command == ls.build_command(cfg) and server.proc is None
  assert opts.ENV_VAR in server.env


def test_main_dry_run(tmp_path, capsys):
  ckpt = _ckpt(tmp_path / "ck", layers=6)
  assert ls.main(["launch_sglang", f"--model_path={ckpt}", "--port=30123", "--dry_run",
                  "--record_guidance", "--guided_layers=4,5"]) == 0
  out = capsys.readouterr().out.splitlines()
  cmd = out[0].split()
  assert cmd[1:3] == ["-m", "sglang.launch_server"]
  assert _flag(cmd, "--port") == "30123" and "--disable-radix-cache" in cmd
  env = json.loads(out[1].split("=", 1)[1])
  assert env["guided_layers"] == [4, 5] and env["record_capacity"] == 16384


# ------------------------------------------------------------------------------ processes

FAKE_SERVER = r'''
"""Stand-in for an SGLang server: /health answers 503, then 200 once `delay` seconds passed."""
import http.server, os, signal, subprocess, sys, time

port, delay, mode, pidfile = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
pids = [os.getpid()]
if mode == "exit":
  print("fake server: startup failed", flush=True)
  sys.exit(3)
if mode == "ignore_term":
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "child":  # like SGLang's scheduler processes
  pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)
with open(pidfile, "w") as f:
  f.write(" ".join(map(str, pids)))
start = time.monotonic()


class Handler(http.server.BaseHTTPRequestHandler):
  def do_GET(self):
    ready = mode != "never" and time.monotonic() - start >= delay
    self.send_response(200 if self.path == "/health" and ready else 503)
    self.end_headers()

  def log_message(self, *args):
    pass


print("fake server: listening", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _alive(pid: int) -> bool:
  """Running and not a zombie (an orphan may wait for a reaper in a container)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _wait_dead(pids, timeout=10.0) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if not any(_alive(p) for p in pids):
      return True
    time.sleep(0.05)
  return False


@pytest.fixture
def fake(tmp_path):
  script = tmp_path / "fake_server.py"
  script.write_text(FAKE_SERVER)
  servers = []

  def make(mode="ok", delay=0.3, **kwargs):
    port = _port()
    pidfile = tmp_path / f"pids-{port}"
    cmd = [sys.executable, str(script), str(port), str(delay), mode, str(pidfile)]
    server = ls.SGLangServer(cmd, f"http://127.0.0.1:{port}", log_path=str(tmp_path / "log"),
                             **kwargs)
    server.pidfile = pidfile
    servers.append(server)
    return server

  yield make
  for s in servers:
    s.stop()


def _pids(server, timeout=10.0):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if server.pidfile.exists() and server.pidfile.read_text().strip():
      return [int(p) for p in server.pidfile.read_text().split()]
    time.sleep(0.05)
  raise AssertionError("fake server wrote no pid file")


def test_start_wait_stop(fake):
  server = fake(delay=0.5)
  with server as s:
    assert s.healthy()
    pids = _pids(s)
    assert all(_alive(p) for p in pids)
  assert server.proc is None
  assert _wait_dead(pids)
  assert not server.healthy(timeout=0.5)
  assert server.stop() is None   # idempotent


def test_stop_kills_process_group(fake):
  server = fake(mode="child").start()
  server.wait_healthy(timeout=30)
  pids = _pids(server)
  assert len(pids) == 2
  code = server.stop()
  assert code == -signal.SIGTERM
  assert _wait_dead(pids)


def test_exit_before_healthy_reports_log(fake):
  server = fake(mode="exit").start()
  with pytest.raises(ls.ServerError, match="exited with code 3") as err:
    server.wait_healthy(timeout=30)
  assert "startup failed" in str(err.value)
  assert server.stop() == 3


def test_health_timeout(fake):
  server = fake(mode="never")
  server.health_timeout = 2.0
  with pytest.raises(ls.ServerError, match="not healthy") as err:
    with server:
      pass
  assert server.log_path in str(err.value)
  assert server.proc is None          # __enter__ stopped it


def test_sigkill_after_grace_period(fake):
  server = fake(mode="ignore_term", stop_timeout=0.5).start()
  server.wait_healthy(timeout=30)
  pids = _pids(server)
  t = time.monotonic()
  assert server.stop() == -signal.SIGKILL
  assert time.monotonic() - t < 10
  assert _wait_dead(pids)


def test_api_key_header(fake, monkeypatch):
  seen = {}

  class Resp:
    status = 200

    def __enter__(self):
      return self

    def __exit__(self, *a):
      return False

  def urlopen(req, timeout):
    seen.update(url=req.full_url, auth=req.get_header("Authorization"))
    return Resp()

  monkeypatch.setattr(ls.urllib.request, "urlopen", urlopen)
  server = ls.SGLangServer(["true"], "http://127.0.0.1:1/", api_key="secret")
  assert server.healthy()
  assert seen == {"url": "http://127.0.0.1:1/health", "auth": "Bearer secret"}
