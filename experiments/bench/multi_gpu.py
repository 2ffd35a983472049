"""Expert parallelism on 1 vs N devices of one host, side by side in one process:
the training step's tokens/s and the rollout engine's decode tokens/s.

  python -m experiments.bench.multi_gpu --preset=h200 --devices=1,2 --json_out=/tmp/mg.json
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.bench.multi_gpu \\
      --preset=cpu                                                  # CPU smoke run

For each device count n: a mesh of n devices along `expert` (`--mesh_axis=expert`; `data`
splits the batch instead), or no mesh for n = 1. Decode is `InProcessEngine(mesh=)` greedily
generating `--new_tokens` after `--prompt_len`-token prompts at `--decode_batch` (prefill
included, as `experiments.bench.rollout` counts it). The training step (`--train_step`) is
`train.step.grpo_step` on the first count's rollout (its tokens and log-probs, and under a
guided policy its guidance records and the expert ids that match them: the same batch for
every n), or `train.step.sft_step` on `--train_batch` x `--seq` random tokens; forward,
backward and AdamW, its MoE blocks expert-parallel on the mesh (`ShardedStep`), the params
placed by `sharding.shard_params`. Every timing is the median of `--reps` calls after one
compiling call. Side-by-side checks against the first count: each n's first loss and grad
norm (relative difference), its greedy tokens' agreement, and, where the engine records
(guided policies), the share of its records' elements (guidance and routing, per layer) equal
bit for bit over the tokens both runs generated alike. Each part also records its devices'
allocator counters (GB in use and the process's peak, the largest over the case's devices;
none on CPU).

Top-level plain numbers: `n_gpu_over_one` {n: train tokens/s over n = 1's},
`n_gpu_decode_over_one`, and for n = 2 `two_gpu_over_one` and `two_gpu_decode_over_one`
(the targets: >= 1.8x).

Model (h200 preset): Qwen3-30B-A3B layer width (hidden 2048, 32 / 4 heads of 128, experts of
width 768, top-8) with 128 experts, `--layers` layers (default 4), vocab 32768, BF16; decode
through the kernels (`decode_impl="kernel"`), training's grouped GEMMs `moe_impl="kernel"`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import flags

from experiments import common

FLAGS = flags.FlagValues()
flags.DEFINE_enum("preset", "h200", ["h200", "cpu"], "Model and sizes.", flag_values=FLAGS)
flags.DEFINE_list("devices", [], "Device counts to compare (default: 1 and all devices).",
                  flag_values=FLAGS)
flags.DEFINE_enum("mesh_axis", "expert", ["expert", "data"], "The mesh axis the n devices "
                  "form.", flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Decoder layers (0: per preset).", flag_values=FLAGS)
flags.DEFINE_integer("experts", 0, "Routed experts (0: per preset).", flag_values=FLAGS)
flags.DEFINE_string("policy", "bf16", "Forward of both parts (a guided one, e.g. fp4_trace: "
                    "the engine records guidance and the GRPO step rounds under it).",
                    flag_values=FLAGS)
flags.DEFINE_enum("train_step", "grpo", ["grpo", "sft"], "The training step timed: GRPO on the "
                  "first device count's rollout, or SFT on random tokens.", flag_values=FLAGS)
flags.DEFINE_integer("train_batch", 0, "SFT sequences per step (0: per preset).",
                     flag_values=FLAGS)
flags.DEFINE_integer("seq", 0, "SFT sequence length (0: per preset).", flag_values=FLAGS)
flags.DEFINE_integer("decode_batch", 0, "Decode batch (0: per preset).", flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 0, "Prompt tokens (0: per preset).", flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 0, "Generated tokens per sequence (0: per preset).",
                     flag_values=FLAGS)
flags.DEFINE_integer("reps", 3, "Timed calls per part.", flag_values=FLAGS)
flags.DEFINE_boolean("train", True, "Time the training step.", flag_values=FLAGS)
flags.DEFINE_boolean("decode", True, "Time the engine's decode.", flag_values=FLAGS)
flags.DEFINE_string("json_out", "", "JSON output path ('' = none).", flag_values=FLAGS)

PRESETS = {
    "h200": dict(layers=4, experts=128, train_batch=8, seq=1024, decode_batch=64,
                 prompt_len=128, new_tokens=64),
    "cpu": dict(layers=2, experts=8, train_batch=4, seq=32, decode_batch=8, prompt_len=8,
                new_tokens=8),
}


def _size(name: str) -> int:
  return FLAGS[name].value or PRESETS[FLAGS.preset][name]


def model_config() -> Any:
  from trace_jax import model as M
  layers, experts = _size("layers"), _size("experts")
  if FLAGS.preset == "cpu":
    return M.tiny(num_hidden_layers=layers, num_experts=experts, policy=FLAGS.policy,
                  dtype="bfloat16")
  return M.qwen3_30b_a3b(num_hidden_layers=layers, num_experts=experts, vocab_size=32768,
                         dtype="bfloat16", policy=FLAGS.policy, moe_impl="kernel",
                         decode_impl="kernel", max_position_embeddings=4096)


def make_mesh(n: int) -> Any:
  import jax

  from trace_jax.model import sharding
  return None if n == 1 else sharding.make_mesh({FLAGS.mesh_axis: n}, jax.devices()[:n])


def sft_batch(config: Any) -> tuple[dict[str, Any], int]:
  """`--train_batch` x `--seq` random tokens as an SFT batch, and its token count."""
  import jax
  import jax.numpy as jnp
  b, s = _size("train_batch"), _size("seq")
  toks = jax.random.randint(jax.random.key(1), (b, s + 1), 0, config.vocab_size)
  return dict(inputs=toks[:, :-1], targets=toks[:, 1:],
              loss_mask=jnp.ones((b, s), jnp.int32)), b * s


def grpo_batch(config: Any, samples: list[Any], records: dict[str, Any] | None) -> Any:
  """The GRPO step's batch from a rollout: its samples (tokens, log-probs), advantages +-1
  (seeded), and under a guided policy the records the learner hands the training forward
  (guidance, and the guided layers' expert ids that match it)."""
  from trace_jax.train import batch as batch_lib
  adv = np.random.default_rng(2).choice([-1.0, 1.0], len(samples))
  guidance = routing = None
  if config.forward.guided:
    if records is None:
      raise RuntimeError(f"policy {config.policy!r} is guided, but the engine recorded nothing")
    guidance = records["guidance"]
    routing = {layer: records["routing"][layer] for layer in config.guided_layers} or None
  return batch_lib.rl_batch(samples, adv, _size("prompt_len") + _size("new_tokens"), guidance,
                            routing)


def time_train(config: Any, params: Any, mesh: Any, batch: Any, tokens: int
               ) -> dict[str, Any]:
  """Median seconds of `--train_step` on `batch` (the state donated, so each call feeds the last
  one's state), its first call's loss and grad norm."""
  import jax

  from trace_jax.model import sharding
  from trace_jax.train import step as step_lib
  placed = (jax.device_put(params, jax.devices()[0]) if mesh is None
            else sharding.shard_params(params, mesh))
  tx = step_lib.make_optimizer(step_lib.OptimConfig(lr=1e-5, total_steps=100))
  state = step_lib.init_state(placed, tx)
  if FLAGS.train_step == "grpo":
    rl = step_lib.RLConfig()
    call = lambda st: step_lib.grpo_step(st, batch, config=config, tx=tx, rl=rl)[:2]
  else:
    call = lambda st: step_lib.sft_step(st, batch, config=config, tx=tx)
  t0 = time.perf_counter()
  state, out = call(state)
  first = {k: float(out[k]) for k in ("loss", "grad_norm")}
  first_s = time.perf_counter() - t0
  times = []
  for _ in range(FLAGS.reps):
    t0 = time.perf_counter()
    state, out = call(state)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
  med = float(np.median(times))
  return dict(step=FLAGS.train_step, first_loss=first["loss"],
              first_grad_norm=first["grad_norm"], first_call_s=first_s, median_s=med,
              tokens=tokens, tokens_per_s=tokens / med, memory=_memory(mesh))


def time_decode(config: Any, params: Any, mesh: Any
                ) -> tuple[dict[str, Any], list[Any], dict[str, Any] | None]:
  """Median seconds of one greedy `generate` call of the whole batch; the first call's samples
  and records (`InProcessEngine.last_guidance`: None where the engine records nothing)."""
  from trace_jax.rollout.engine import InProcessEngine
  from trace_jax.rollout.protocol import SamplingParams
  b, p, new = _size("decode_batch"), _size("prompt_len"), _size("new_tokens")
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, config.vocab_size, (b, p)).tolist()
  sp = SamplingParams(max_new_tokens=new, temperature=0.0)
  engine = InProcessEngine(params, config, max_batch=b, mesh=mesh)
  t0 = time.perf_counter()
  samples = engine.generate(prompts, sp)
  records = engine.last_guidance
  first_s = time.perf_counter() - t0
  times = []
  for _ in range(FLAGS.reps):
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp)
    times.append(time.perf_counter() - t0)
  engine.close()
  tokens = sum(len(s.tokens) for s in out)
  if tokens != b * new:  # greedy without stop ids: every row runs to the end
    raise RuntimeError(f"generated {tokens} tokens, expected {b} x {new}")
  med = float(np.median(times))
  return (dict(first_call_s=first_s, median_s=med, tokens_per_s=tokens / med,
               memory=_memory(mesh)), samples, records)


def _memory(mesh: Any) -> dict[str, float] | None:
  """The allocator's counters of the case's devices (`common.device_memory`; None on CPU)."""
  import jax
  return common.device_memory(jax.devices()[:1] if mesh is None else mesh.devices.flat)


def records_agreement(records: dict[str, Any], ref: dict[str, Any], rows: list[int],
                      counts: list[int], ref_counts: list[int]) -> dict[str, float]:
  """{layer: share of elements equal bit for bit} of the guidance and routing records of two
  rollouts of the same prompts, over each sequence's first rows[i] rows (those both runs
  produced from the same tokens). Records are ragged rows in sequence order (counts[i] rows of
  sequence i here, ref_counts[i] there), as `InProcessEngine.last_guidance` gives them."""
  import jax

  def starts(c):
    return np.concatenate([[0], np.cumsum(c)[:-1]]).astype(int)
  mine, theirs = starts(counts), starts(ref_counts)
  take = np.concatenate([np.arange(k) for k in rows]).astype(int)
  seq = np.repeat(np.arange(len(rows)), rows)
  idx, ref_idx = mine[seq] + take, theirs[seq] + take
  out: dict[str, float] = {}
  for layer in sorted(set(ref.get("guidance", {})) | set(ref.get("routing", {}))):
    equal = total = 0
    trees = [(records.get(k, {}).get(layer), ref.get(k, {}).get(layer))
             for k in ("guidance", "routing")]
    for mine_t, ref_t in trees:
      if ref_t is None:
        continue
      if mine_t is None:
        raise ValueError(f"layer {layer}: the reference has records this rollout lacks")
      for x, y in zip(jax.tree.leaves(mine_t), jax.tree.leaves(ref_t)):
        x, y = common.bits(np.asarray(x)[idx]), common.bits(np.asarray(y)[ref_idx])
        equal += int(np.sum(x == y))
        total += x.size
    out[str(layer)] = equal / total if total else float("nan")
  return out


def run_bench() -> dict[str, Any]:
  import jax

  from trace_jax import model as M
  counts = [int(n) for n in FLAGS.devices] or sorted({1, len(jax.devices())})
  if max(counts) > len(jax.devices()) or min(counts) < 1:
    raise ValueError(f"--devices {counts}: this host has {len(jax.devices())} devices")
  if FLAGS.train and FLAGS.train_step == "grpo" and not FLAGS.decode:
    raise ValueError("--train_step=grpo trains on the first device count's rollout: it needs "
                     "--decode (or --train_step=sft)")
  config = model_config()
  if FLAGS.mesh_axis == "expert" and any(config.num_experts % n for n in counts):
    raise ValueError(f"--devices {counts} must divide the {config.num_experts} experts")
  res: dict[str, Any] = dict(common.device_description(), model=config.shape_fields(),
                             policy=config.policy, train_step=FLAGS.train_step,
                             sizes={k: _size(k) for k in PRESETS["cpu"]})
  res.update(common.bandwidth_gbps(), **common.matmul_tflops())
  params = M.init_params(config, 0, param_dtype="float32")
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
  print(f"bench_multi_gpu: {res['device_kind']} x {len(jax.devices())}, copy "
        f"{res['copy_gbps']:.0f} GB/s, BF16 matmul {res['bf16_tflops']:.0f} TFLOP/s (device 0); "
        f"{config.num_hidden_layers} layers, {config.num_experts} experts, {n_params / 1e9:.2f}B "
        f"params; policy {config.policy}; mesh axis {FLAGS.mesh_axis}", flush=True)
  cases: dict[str, Any] = {}
  first: dict[str, Any] = {}  # the first count's rollout: reference tokens, records, batch
  for n in counts:
    mesh = make_mesh(n)
    case: dict[str, Any] = {}
    if FLAGS.decode:
      case["decode"], samples, records = time_decode(config, params, mesh)
      tokens = [s.tokens for s in samples]
      if not first:
        first = dict(tokens=tokens, samples=samples, records=records)
      same = [int(np.argmin(np.asarray(x) == np.asarray(y))) if x != y else len(x)
              for x, y in zip(tokens, first["tokens"])]  # leading tokens equal
      agree = float(np.mean([a == b for x, y in zip(tokens, first["tokens"])
                             for a, b in zip(x, y)]))
      d = case["decode"]
      d["token_agreement_with_first"] = agree
      if records is not None:
        # rows of a sequence's records: its prompt's and the tokens fed before a difference
        rows = [min(len(s.prompt) + k, s.num_rows) for s, k in zip(samples, same)]
        d["records_equal_with_first"] = records_agreement(
            records, first["records"], rows, [s.num_rows for s in samples],
            [s.num_rows for s in first["samples"]])
      print(f"  {n} device(s) decode: {d['tokens_per_s']:>12,.0f} tok/s  first call "
            f"{d['first_call_s']:6.1f} s  greedy tokens equal to {counts[0]} device(s)': "
            f"{100 * agree:.1f}%{_memory_text(d)}", flush=True)
      if "records_equal_with_first" in d:
        print("    records equal bit for bit to the first count's, by layer: " + ", ".join(
            f"{k} {100 * v:.2f}%" for k, v in d["records_equal_with_first"].items()),
            flush=True)
    if FLAGS.train:
      if FLAGS.train_step == "grpo":
        if "batch" not in first:
          first["batch"] = grpo_batch(config, first["samples"], first["records"])
        batch, tokens = first["batch"], int(np.asarray(first["batch"].valid).sum())
      else:
        batch, tokens = sft_batch(config)
      case["train"] = time_train(config, params, mesh, batch, tokens)
      t = case["train"]
      print(f"  {n} device(s) train ({t['step']}): {t['tokens_per_s']:>12,.0f} tok/s  "
            f"{t['median_s'] * 1e3:8.1f} ms/step  first call {t['first_call_s']:6.1f} s  "
            f"loss {t['first_loss']:.6f}  grad norm {t['first_grad_norm']:.6f}"
            f"{_memory_text(t)}", flush=True)
    cases[str(n)] = case
  res["cases"] = cases
  res.update(summary(cases, counts))
  for k, v in res.items():
    if k.endswith("_over_one") and not isinstance(v, dict):
      print(f"  {k}: {v:.3f}")
  return res


def _memory_text(part: dict[str, Any]) -> str:
  m = part.get("memory")
  return "" if m is None else (f"  memory per device (max) {m['bytes_in_use_gb_max']:.1f} GB, "
                               f"peak {m['peak_bytes_in_use_gb_max']:.1f} GB")


def summary(cases: dict[str, Any], counts: Sequence[int]) -> dict[str, Any]:
  """Ratios of every device count's tokens/s to the first count's, and the loss checks."""
  out: dict[str, Any] = {}
  base = cases[str(counts[0])]
  for part, key in (("train", "n_gpu_over_one"), ("decode", "n_gpu_decode_over_one")):
    if part not in base:
      continue
    out[key] = {str(n): cases[str(n)][part]["tokens_per_s"] / base[part]["tokens_per_s"]
                for n in counts}
    if counts[0] == 1 and "2" in out[key]:
      out["two_gpu_over_one" if part == "train" else "two_gpu_decode_over_one"] = out[key]["2"]
  if "train" in base:
    for name, field in (("first_loss_rel_diff", "first_loss"),
                        ("first_grad_norm_rel_diff", "first_grad_norm")):
      ref = base["train"].get(field)
      if ref is not None:
        out[name] = {str(n): abs(cases[str(n)]["train"][field] - ref) / abs(ref)
                     for n in counts}
  return out


def main(argv: Sequence[str]) -> dict[str, Any] | None:
  if not common.parse_flags(FLAGS, argv):
    return None
  common.set_gpu_memory_env()
  return common.finish(run_bench(), FLAGS)


if __name__ == "__main__":
  main(sys.argv)
