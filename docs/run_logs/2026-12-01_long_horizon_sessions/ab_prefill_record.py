"""A/B: long_horizon fp4_trace with engine sessions vs the transcript re-prefill path."""
import json, sys
from configs import long_horizon
from trace_jax.io import orbax_ckpt
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.train import rl_loop

class NoSessions:
  """The in-process engine without open_session: episodes.play falls back to re-prefill."""
  def __init__(self, inner): self._e = inner
  def generate(self, *a, **k): return self._e.generate(*a, **k)
  def update_weights(self, p): return self._e.update_weights(p)
  def close(self): return self._e.close()

cfg = long_horizon.get_config()
_, params = orbax_ckpt.load_orbax("/tmp/lh/run/sft")
audit = 1.0
def factory(p, c, w):
  return NoSessions(InProcessEngine(p, c, guidance_writer=w, record_guidance=True,
      record_routing=True, audit_fraction=audit, max_batch=64, min_prompt_len=cfg.max_prompt_len))
out = rl_loop.run_rl(cfg, "/tmp/lh_ab/fp4_trace_prefill", "fp4_trace", params,
                     engine_factory=factory, progress=False)
print(json.dumps({k: out["summary"][k] for k in ("mean_abs_dlogp", "k3_kl", "flip_rate_guided", "flip_rate_unguided", "final_reward")}))
