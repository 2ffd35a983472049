"""The quickstart with an 8-layer model (the guided layers 4-7 by default): the CPU config on
which the guidance budget's selection is measured against TRACE's deeper-half rule.

  python -m experiments.measure_mismatch --config=configs/quickstart_deep.py \\
      --json_out=runs/budget/deep.json --guidance_budget_sweep
  python -m experiments.train_rl --config=configs/quickstart_deep.py --workdir=runs/deep
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  c = quickstart.get_config()
  c.model.num_hidden_layers = 8
  return c
