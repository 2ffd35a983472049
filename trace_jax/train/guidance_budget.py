"""Guidance where it pays: the guided layers chosen from measured mismatch under a byte budget.

TRACE guides "the deeper layers" to bound the bytes its guidance costs. Here the choice is
measured instead (docs/design.md §5): a calibration rollout under `fp4_trace` records guidance
of every layer (`calibration_rollout`); the trainer's forward then scores the same tokens with
guidance at a candidate set of layers, and the rollout/trainer mean |dlogp| of the sampled
tokens measures what that set removes (`LayerScorer`). Units are whole layers: a layer's
sites share one record layout and the engine records per layer; each costs the bytes per
token of its compact record and the expert ids that place it (`layer_bytes_per_token`).

Selection is greedy forward selection (`greedy_path`): from no guidance, add the layer whose
addition lowers |dlogp| most, given the layers already chosen, until no layer fits the budget.
A layer's effect depends on the others (guiding a layer changes the inputs of every layer
above it, and a guided layer fed drifted inputs repairs less), so each step is measured with
the chosen set in place, not ranked once alone; greedy is exact for one layer and costs
L + (L-1) + ... forwards, against 2^L for the best subset. Ties go to the deeper layer, so a
selection is a function of the calibration's tokens (its seed) alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from trace_jax.guidance import record
from trace_jax.model.config import SITES, ModelConfig
from trace_jax.rl import losses
from trace_jax.rollout.engine import InProcessEngine
from trace_jax.rollout.protocol import Sample, SamplingParams
from trace_jax.train import mismatch, scoring

log = logging.getLogger(__name__)


class BudgetError(ValueError):
  """A budget no unit fits, or units the model does not have."""


@dataclasses.dataclass(frozen=True)
class Rollout:
  """A calibration (or evaluation) rollout: the samples, and what the engine recorded with
  every layer guided (`rec`: guidance, routing, full-code audit of every row)."""
  samples: list[Sample]
  rec: dict[str, Any]

  @property
  def sequences(self) -> list[list[int]]:
    return [s.prompt + s.tokens for s in self.samples]

  @property
  def tokens(self) -> int:
    return int(sum(self.rec["token_counts"]))


def calibration_rollout(params: Any, config: ModelConfig, prompts: Sequence[Sequence[int]],
                        sampling: Sequence[SamplingParams]) -> Rollout:
  """The rollout of `config` (an FP4 rollout forward) recording every layer's guidance, all
  sites, with every row's full codes audited."""
  every = config.replace(guided_layers=tuple(range(config.num_hidden_layers)))
  engine = InProcessEngine(params, every, audit_fraction=1.0)
  samples = engine.generate(prompts, sampling)
  rec = engine.last_guidance
  engine.close()
  return Rollout(samples, rec)


def layer_bytes(config: ModelConfig) -> float:
  """Bytes per token that guiding one layer of `config` costs, from the record's layout
  (`guidance.record`): the compact (or full) record of moe_in (one row of hidden_size),
  expert_mid (top-k rows of moe_intermediate_size), k and v (a row of head_dim per KV head),
  and the int32 expert ids. Every layer costs the same."""
  fmt = config.forward.fp4 or "nvfp4"
  row = lambda k: record.bytes_per_row(k, config.guidance_mode, fmt)
  return float(row(config.hidden_size) + config.num_experts_per_tok * (
      row(config.moe_intermediate_size) + 4) + 2 * config.num_key_value_heads * row(
          config.head_dim))


def layer_bytes_per_token(ro: Rollout, layers: Sequence[int]) -> dict[int, float]:
  """Bytes per token that guiding each layer cost in the rollout `ro`: its training record
  (every site, in the config's guidance mode) and the expert ids that place its expert_mid
  rows, as the store holds them."""
  g = ro.rec["guidance"]
  return {layer: (sum(g[layer][site].nbytes for site in SITES)
                  + ro.rec["routing"][layer].nbytes) / ro.tokens for layer in layers}


@dataclasses.dataclass
class LayerScorer:
  """Mismatch of the training forward guided at a set of layers, on one rollout's tokens.

  train_config: the trainer's forward (`fp4_trace`'s). `__call__(layers)` scores the rollout's
  sequences with the rollout's guidance at `layers` only (RTN elsewhere) and returns mean
  |dlogp| (a forward without taps: the calibration's many candidates compile lighter);
  `metrics(layers)` adds K3 KL and the FP4 code flips in and outside those layers (a forward
  tapping every layer). Results are cached per set.
  """
  params: Any
  train_config: ModelConfig
  rollout: Rollout
  _cache: dict[tuple[tuple[int, ...], bool], dict[str, float]] = dataclasses.field(
      default_factory=dict)

  def __call__(self, layers: Sequence[int]) -> float:
    return self._get(layers, taps=False)["mean_abs_dlogp"]

  def metrics(self, layers: Sequence[int]) -> dict[str, float]:
    return self._get(layers, taps=True)

  def _get(self, layers: Sequence[int], taps: bool) -> dict[str, float]:
    key = (tuple(sorted(int(i) for i in layers)), taps)
    if key not in self._cache:
      self._cache[key] = self._measure(*key)
    return self._cache[key]

  def _measure(self, layers: tuple[int, ...], taps: bool) -> dict[str, float]:
    ro = self.rollout
    every = tuple(range(self.train_config.num_hidden_layers)) if taps else ()
    config = self.train_config.replace(guided_layers=layers)
    out = scoring.score(self.params, config, ro.sequences,
                        guidance={i: ro.rec["guidance"][i] for i in layers} or None,
                        routing={i: ro.rec["routing"][i] for i in layers} or None,
                        tap_layers=every, tap_mode="full" if taps else None)
    lt = np.concatenate([lp[len(s.prompt) - 1:] for lp, s in zip(out["logprobs"], ro.samples)])
    lr = np.concatenate([np.asarray(s.logprobs, np.float32) for s in ro.samples])
    m = losses.mismatch_metrics(jnp.asarray(lt), jnp.asarray(lr), jnp.ones_like(jnp.asarray(lt)))
    result = {"mean_abs_dlogp": float(m["mean_abs_dlogp"]), "k3_kl": float(m["k3_kl"])}
    if taps:
      train_routing = {i: t.pop("routing") for i, t in out["taps"].items()}
      counts = mismatch.compare(out["taps"], ro.rec["audit"]["guidance"], train_routing,
                                ro.rec["routing"], layers).metrics()
      result.update(flip_rate_guided=counts["flip_rate_guided"],
                    flip_rate_unguided=counts["flip_rate_unguided"])
    return result


def greedy_path(score: Callable[[tuple[int, ...]], float], unit_bytes: Mapping[int, float],
                budget: float | None = None, progress: bool = False) -> list[dict[str, Any]]:
  """Greedy forward selection: the steps from no unit, each adding the unit (of `unit_bytes`)
  whose addition scores lowest with the chosen ones in place, while one fits `budget` bytes per
  token (None: every unit). Each step: {"layers", "added", "bytes_per_token", "score"}.
  progress: a bar over the forwards scored."""
  from tqdm.auto import tqdm

  n = len(unit_bytes)
  bar = tqdm(total=n * (n + 1) // 2 + 1, desc="guidance budget", disable=not progress,
             dynamic_ncols=True)
  chosen: tuple[int, ...] = ()
  path = [{"layers": [], "added": None, "bytes_per_token": 0.0, "score": score(())}]
  bar.update(1)
  spent = 0.0
  while True:
    fits = [u for u in unit_bytes if u not in chosen and
            (budget is None or spent + unit_bytes[u] <= budget * (1 + 1e-9))]
    if not fits:
      bar.close()
      return path
    scored = {}
    for u in fits:
      scored[u] = score(tuple(sorted(chosen + (u,))))
      bar.update(1)
    best = min(fits, key=lambda u: (scored[u], -u))  # ties: the deeper layer
    chosen = tuple(sorted(chosen + (best,)))
    spent += unit_bytes[best]
    path.append({"layers": list(chosen), "added": best, "bytes_per_token": spent,
                 "score": scored[best]})
    bar.set_postfix(layers=str(list(chosen)), dlogp=f"{scored[best]:.5f}")
    log.info("guidance budget: + layer %d -> %s, %.1f B/token, |dlogp| %.5f", best, chosen,
             spent, scored[best])


def select(path: Sequence[Mapping[str, Any]], budget: float) -> tuple[int, ...]:
  """The layers of the last greedy step within `budget` bytes per token."""
  steps = [s for s in path if s["bytes_per_token"] <= budget * (1 + 1e-9)]
  return tuple(steps[-1]["layers"])


def check_budget(budget: float, unit_bytes: Mapping[int, float]) -> None:
  """Raises BudgetError unless `budget` is a finite number that fits the cheapest unit."""
  if not (isinstance(budget, (int, float)) and np.isfinite(budget)):
    raise BudgetError(f"guidance budget must be a finite number of bytes per token, got "
                      f"{budget!r}")
  cheapest = min(unit_bytes.values())
  if budget < cheapest:
    raise BudgetError(f"guidance budget {budget:g} B/token is below the cheapest layer's "
                      f"guidance ({cheapest:g} B/token): it would guide nothing; use "
                      f">= {cheapest:g}, or a policy without guidance")


def deepest(k: int, num_layers: int) -> tuple[int, ...]:
  """TRACE's rule: the deepest k layers."""
  return tuple(range(num_layers - k, num_layers))


def curve(held_out: LayerScorer, path: Sequence[Mapping[str, Any]], unit_bytes: Mapping[int, float]
          ) -> list[dict[str, Any]]:
  """The greedy selection of each size against the deepest layers of the same bytes, measured
  on `held_out` (a scorer of prompts the calibration did not see): one point per size k, each
  with {"k", "bytes_per_token", "budgeted": {layers, metrics}, "deepest": {...}}."""
  n = held_out.train_config.num_hidden_layers
  points = []
  for step in path:
    k = len(step["layers"])
    deep = deepest(k, n)
    points.append({
        "k": k, "bytes_per_token": step["bytes_per_token"],
        "deepest_bytes_per_token": float(sum(unit_bytes[i] for i in deep)),
        "budgeted": {"layers": list(step["layers"]), **held_out.metrics(step["layers"])},
        "deepest": {"layers": list(deep), **held_out.metrics(deep)}})
  return points


def plot_curve(points: Sequence[Mapping[str, Any]], title: str, path: str) -> None:
  """Held-out mean |dlogp| against guidance bytes per token: the greedy selection of each size
  and the deepest layers of the same size (k = 0: no guidance)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for ax, metric, label in ((axes[0], "mean_abs_dlogp", "rollout/trainer mean |dlogp|"),
                            (axes[1], "flip_rate_unguided", "FP4 flips outside guided layers")):
    for rule, style in (("budgeted", "o-"), ("deepest", "s--")):
      xs = [p["bytes_per_token"] if rule == "budgeted" else p["deepest_bytes_per_token"]
            for p in points]
      ys = [p[rule][metric] for p in points]
      ax.plot(xs, ys, style, label="greedy, measured" if rule == "budgeted" else "deepest k")
    ax.set_xlabel("guidance bytes per token")
    ax.set_title(label, fontsize=10)
    ax.legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
