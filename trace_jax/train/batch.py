"""Training batches from rollout samples: padded token arrays, masks, advantages, guidance.

Row t of a sequence predicts token t+1, so a sequence of prompt P and completion C tokens gives
P + C - 1 rows; the loss covers the C rows that predict completion tokens. The sequence length
is fixed per run (`seq_len`) so the jitted step compiles once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from trace_jax.guidance import layout as guidance_layout
from trace_jax.rollout.protocol import Sample


def sequence_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                   seq_len: int, completion_masks: Sequence[Sequence[int] | None] | None = None
                   ) -> dict[str, np.ndarray]:
  """inputs/targets [B, seq_len], valid (real rows) and loss_mask (completion rows).

  completion_masks[i], when given, keeps only the completion tokens it marks 1 in the loss
  (a multi-turn episode's actions, not the environment's observations).
  """
  b = len(prompts)
  inputs = np.zeros((b, seq_len), np.int32)
  targets = np.zeros((b, seq_len), np.int32)
  valid = np.zeros((b, seq_len), np.float32)
  loss_mask = np.zeros((b, seq_len), np.float32)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    seq = list(p) + list(c)
    n = len(seq) - 1
    if n > seq_len:
      raise ValueError(f"sequence {i} needs {n} rows, more than seq_len={seq_len}")
    inputs[i, :n] = seq[:-1]
    targets[i, :n] = seq[1:]
    valid[i, :n] = 1.0
    cm = completion_masks[i] if completion_masks is not None else None
    if cm is None:
      loss_mask[i, len(p) - 1:n] = 1.0
    elif len(cm) != len(c):
      raise ValueError(f"sequence {i}: completion mask has {len(cm)} entries for {len(c)} "
                       "completion tokens")
    else:
      loss_mask[i, len(p) - 1:n] = np.asarray(cm, np.float32)
  return {"inputs": inputs, "targets": targets, "valid": valid, "loss_mask": loss_mask}


@struct.dataclass
class RLBatch:
  """One GRPO step's inputs, [B, seq_len] per sequence (row t predicts token t + 1).

  valid: real rows; loss_mask: rows whose target the policy sampled; logp_rollout: the
  rollout's log-prob of each of those targets; advantages [B]; guidance / routing: the
  rollout's records of the guided layers and its expert ids per layer, padded to the rows
  (`trace_jax.guidance.layout`), or None; logp_ref: the reference policy's log-probs
  of the targets when the loss has a KL term (`rl.kl_coef`), else None; logp_old: the
  trainer's log-probs before the batch's first update, which later updates clip against
  (several updates per batch: `rl.minibatches`, `rl.epochs`), else None (one update: the
  ratio is 1). Every leaf has the sequences on its first axis (`take_rows`).
  """
  inputs: jax.Array
  targets: jax.Array
  valid: jax.Array
  loss_mask: jax.Array
  logp_rollout: jax.Array
  advantages: jax.Array
  guidance: dict[int, dict[str, Any]] | None = None
  routing: dict[int, jax.Array] | None = None
  logp_ref: jax.Array | None = None
  logp_old: jax.Array | None = None

  @property
  def num_sequences(self) -> int:
    return int(self.inputs.shape[0])


def take_rows(batch: RLBatch, rows: np.ndarray) -> RLBatch:
  """The sequences `rows` (indices) of a batch: every array, guidance and routing included."""
  idx = jnp.asarray(np.asarray(rows, np.int32))
  n = batch.num_sequences
  bad = [jax.tree_util.keystr(k) for k, a in jax.tree_util.tree_leaves_with_path(batch)
         if np.ndim(a) == 0 or np.shape(a)[0] != n]
  if bad:
    raise ValueError(f"batch leaves {bad[:3]} do not have the {n} sequences on their first axis")
  return jax.tree.map(lambda a: a[idx], batch)


def rl_batch(samples: Sequence[Sample], advantages: np.ndarray, seq_len: int,
             guidance: Mapping[int, Mapping[str, Any]] | None = None,
             routing: Mapping[int, Any] | None = None) -> RLBatch:
  """The GRPO step's batch; guidance/routing are ragged rows in sample order (or None)."""
  seqs = sequence_batch([s.prompt for s in samples], [s.tokens for s in samples], seq_len,
                        [s.meta.get("loss_mask") for s in samples])
  logp_rollout = np.zeros((len(samples), seq_len), np.float32)
  for i, s in enumerate(samples):
    p = len(s.prompt)
    logp_rollout[i, p - 1:p - 1 + len(s.tokens)] = s.logprobs
  guidance, routing = guidance_layout.pad_records(guidance, routing,
                                                  [s.num_rows for s in samples], seq_len)
  return RLBatch(
      **{k: jnp.asarray(v) for k, v in seqs.items()}, logp_rollout=jnp.asarray(logp_rollout),
      advantages=jnp.asarray(advantages, jnp.float32), guidance=guidance, routing=routing)
