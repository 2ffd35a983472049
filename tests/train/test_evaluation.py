"""A run's summary (`trace_jax.train.evaluation.summarize`): rewards from the evals, means of
the mismatch metrics, medians of the wall-clock ones."""

import numpy as np

from trace_jax.train import evaluation, run_log


def test_a_compiling_first_step_does_not_move_the_timings_but_counts_in_the_mismatch():
  history = [{"step": i, "reward": 0.1 * i, "mean_abs_dlogp": d, "step_s": s,
              "rollout_tokens_per_s": t, "audit_s": None if i == 3 else 0.2}
             for i, (d, s, t) in enumerate([(0.004, 40.0, 90.0), (0.002, 1.0, 5000.0),
                                            (0.002, 1.2, 4800.0), (0.002, 0.9, 5100.0)])]
  evals = [{"step": 0, "reward": 0.3}, {"step": 4, "reward": 0.5}]
  s = evaluation.summarize(history, evals)
  assert (s["start_reward"], s["final_reward"], s["best_reward"]) == (0.3, 0.5, 0.5)
  assert s["mean_abs_dlogp"] == np.mean([0.004, 0.002, 0.002, 0.002])
  assert s["step_s"] == 1.1 and s["rollout_tokens_per_s"] == 4900.0  # not 10.8 s, 3748 tok/s
  assert s["audit_s"] == 0.2  # steps without the figure are left out
  assert s["guidance_s"] is None and set(run_log.TIMING_KEYS) <= set(s)
  np.testing.assert_allclose(s["train_reward_slope"], 0.1)
