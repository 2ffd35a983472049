"""GRPO with low-precision rollout: SFT warm start, then one run per precision policy.

  python -m experiments.train_rl --config=configs/quickstart.py --workdir=runs/quickstart

Runs the config's SFT warm start (or loads --sft_checkpoint), then GRPO under every policy in
`config.policies` from that same start, and writes per policy metrics.csv, evals.csv,
TensorBoard summaries and checkpoints (a killed run resumes where it stopped), and for the
whole run a comparison table, `summary.json` and `reward_mismatch.png`. Rollout goes through
the in-process engine by default, or an HTTP server (ours or SGLang) with --rollout_url.
--sft_only then --policies=<p> per process splits the policies over processes (README);
--report_only then writes the table from the runs as they stand, resuming none.
The workdir keeps the config it was started with (`run_config.json`): a launch with another
config is refused unless --allow_config_change; a launch that would write a run another live
launch is writing is refused. Mistakes in the config, flags or workdir print one line,
`error: ...`, and exit 2; faults (disk full, no checkpoint restores, NaN in the weights) exit 1
the same way, with the traceback in workdir/error.log (docs/reliability.md).
"""

import os
from collections.abc import Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from trace_jax.train import run_guard

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py",
                                          "Experiment config (.py with get_config()).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/quickstart", "Output directory.")
_POLICIES = flags.DEFINE_list("policies", None, "Override config.policies.")
_SFT_CKPT = flags.DEFINE_string("sft_checkpoint", None,
                                "Orbax checkpoint (experiments.sft) to start from.")
_ROLLOUT_URL = flags.DEFINE_string("rollout_url", None,
                                   "Roll out through this HTTP server (ours or SGLang).")
_API_KEY = flags.DEFINE_string("api_key", None, "Bearer token for --rollout_url (visible in `ps`: "
                               "prefer --api_key_file or $TRACE_API_KEY).")
_API_KEY_FILE = flags.DEFINE_string("api_key_file", None, "Read --rollout_url's bearer token from "
                                    "this file (whitespace stripped).")
_NO_PROGRESS = flags.DEFINE_bool("no_progress", False, "Disable progress bars.")
_SFT_ONLY = flags.DEFINE_bool(
    "sft_only", False, "Run (or load) the SFT warm start into workdir/sft and stop, so that "
    "policies can then run as separate processes with --policies on the same workdir.")
_REPORT_ONLY = flags.DEFINE_bool(
    "report_only", False, "Write the comparison table, summary.json and plot from the runs "
    "under workdir as they stand (a seed cut short counts with the steps it reached); train, "
    "resume and evaluate nothing.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Multi-host: call jax.distributed.initialize() first (one process "
    "per host; the coordinator, process count and id come from the cluster's environment, "
    "e.g. SLURM, or from the --coordinator_address/--num_processes/--process_id flags). "
    "docs/multi_host.md says what has and has not run.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "--distributed: host:port of process 0 (default: detected).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "--distributed: number of processes (default: detected).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "--distributed: this process's id (default: detected).")
_ALLOW_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Continue a workdir started with another config (its "
    "run_config.json records the change) instead of refusing.")


def main(argv: Sequence[str]) -> None:
  del argv
  if not flags.FLAGS["verbosity"].present:  # progress bars and the table; -v 0 for INFO logs
    logging.set_verbosity(logging.WARNING)
  if _DISTRIBUTED.value:  # before anything touches the devices
    import jax
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  # Imported here: flag and config-file errors are reported before the training code loads.
  from trace_jax.train import compare
  cfg = _CONFIG.value
  policies = [] if _SFT_ONLY.value else (_POLICIES.value or list(cfg.policies))
  with run_guard.exit_on_errors(log_dir=_WORKDIR.value):
    if _REPORT_ONLY.value:
      if _SFT_ONLY.value:
        raise run_guard.UserError("--report_only and --sft_only exclude each other")
      compare.report_existing(cfg, _WORKDIR.value, policies)
      return
    factory = None
    if _ROLLOUT_URL.value:
      from rollout_bridge import client, weight_sync
      with run_guard.user_input():
        key = client.resolve_api_key(_API_KEY.value, _API_KEY_FILE.value)
      factory = weight_sync.http_engine_factory(
          _ROLLOUT_URL.value, os.path.join(_WORKDIR.value, "weights"), key)
    compare.run(cfg, _WORKDIR.value, policies, _SFT_CKPT.value, factory,
                progress=not _NO_PROGRESS.value, allow_config_change=_ALLOW_CHANGE.value)


if __name__ == "__main__":
  app.run(main, flags_parser=run_guard.flags_parser(_CONFIG))
