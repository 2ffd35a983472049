"""A/B: long_horizon fp4_trace with the engine's sessions hidden (turns re-prefill the
transcript, guidance from one prefill of the finished episode), from the run's warm start.

  .venv/bin/python docs/run_logs/2026-12-01_long_horizon_sessions/ab_prefill_record.py

Run on 2026-12-01 against /tmp/lh/run (the `train_rl --config=configs/long_horizon.py` run of
that day); its output is ab_prefill_record.log.
"""

import json

from configs import long_horizon
from trace_jax.io import orbax_ckpt
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.train import rl_loop


class NoSessions:
  """The in-process engine without open_session: episodes.play re-prefills every turn."""

  def __init__(self, inner):
    self._e = inner

  def generate(self, *a, **k):
    return self._e.generate(*a, **k)

  def update_weights(self, p):
    return self._e.update_weights(p)

  def close(self):
    return self._e.close()


def main() -> None:
  cfg = long_horizon.get_config()
  _, params = orbax_ckpt.load_orbax("/tmp/lh/run/sft")

  def factory(p, c, store):
    return NoSessions(InProcessEngine(p, c, guidance_store=store, record_guidance=True,
                                      record_routing=True, audit_fraction=1.0, max_batch=64,
                                      min_prompt_len=cfg.max_prompt_len))

  out = rl_loop.run_rl(cfg, "/tmp/lh_ab/fp4_trace_prefill", "fp4_trace", params,
                       engine_factory=factory, progress=False)
  keys = ("mean_abs_dlogp", "k3_kl", "flip_rate_guided", "flip_rate_unguided", "final_reward")
  print(json.dumps({k: out["summary"][k] for k in keys}))


if __name__ == "__main__":
  main()
