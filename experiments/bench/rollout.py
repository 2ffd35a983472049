"""Decode speed of the embedded rollout engine: BF16 vs FP4 (and FP8: `--policies=bf16,
fp8_unified,...`) policies, XLA vs kernel decode, at fixed batch and at a fixed memory budget,
against HF transformers `generate` on the same checkpoint.

  python -m experiments.bench.rollout --json_out=/tmp/rollout.json          # GPU preset
  python -m experiments.bench.rollout --layers=24 --json_out=/tmp/r24.json  # the 24-layer model
  python -m experiments.bench.rollout --preset=cpu                          # CPU smoke run

Fixed batch: for each (policy, decode_impl, batch), one `InProcessEngine.generate` call compiles
(its wall time is the program's compile plus one run: `first_call_s`; `compile_s` = that minus
the median call), `--warmup_calls` untimed calls (GPU preset 1: XLA's pinned host pool for the
records grows over the first two calls), then `--reps` timed calls of greedy decoding of
`--new_tokens` tokens after `--prompt_len`-token prompts. Reported: decode tokens/s (batch * new
tokens / median call time, prefill included; for engines that record, plus the records' transfer
still in flight after the last timed call, read back as a consumer would, over `--reps`: the
engine starts each batch's record copy to the host and returns, so the copy overlaps the next
call; `emit_s_per_call`, `emit_bytes_per_call`, `records_drain_s`; `--records_drain=each` waits
for them in every call instead; `generate_s`: the median generate call alone), the bytes a
decode step must read (`step_bytes`: the touched experts' weights as the engine stores them,
attention, router, norms and lm_head weights, the KV cache at the mean length) and their rate
against the device's read and copy bandwidths measured in the same process
(`common.bandwidth_gbps`), and ratios side by side: FP4 over BF16 at each batch, the kernel
decode over XLA's, and an impl with options over the plain one (`--impls=kernel,kernel+unroll2`:
the layer scans two layers per iteration, `ModelConfig.scan_unroll`; `+unrolled`: every layer
compiled apart; `+sync4`: the decode loop's condition checked once per 4 steps,
`ModelConfig.decode_steps_per_sync`; `+moetriton` / `+moewgmma`: the packed experts' kernel,
`ModelConfig.decode_moe_kernel`; `+attnfused` / `+attntriton` / `+attnwgmma`: the decode
attention, `ModelConfig.decode_attention`, "fused" the single-pass kernel; `+kvappend` /
`+kvxla`: the k/v sites written into the packed cache by one kernel or by the site kernel and
XLA's scatters, `ModelConfig.kv_write`), and fp4_trace over fp4_rtn per impl. Every case's
config states its kernel plan (`trace_jax.model.plan`); the fields an entry does not set are the
plan's "auto" on this backend.

Fixed memory (`--budget_gb`, 0 skips it; `--budget_context`, `--budget_max_batch`,
`--budget_policies` (CPU preset: bf16 and fp4_rtn), `--budget_impl`): per policy, how many
sequences of `--budget_context` tokens fit in the budget next to the weights as the engine
stores them (`rollout_bytes`: with decode_impl "kernel", packed NVFP4 experts under FP4, E4M3
experts and attention projections under FP8, the rest BF16), each sequence costing its KV
cache (packed NVFP4 under the FP4 policies with decode_impl "kernel"; else
BF16) and the records its session turn holds on the device (fp4_trace's guidance and routing
of the fed token and the decode steps; a session's earlier records are in host memory); then the
decode of `--new_tokens` tokens in one engine session turn (`InProcessEngine.extend`) at that
batch (capped at `--budget_max_batch`) over caches of `--budget_context` tokens. The caches
hold zeros instead of a prefill's values: the XLA prefill materializes [batch, heads, S, S]
float32 scores (8.3 GB per 8k sequence on the GPU preset), and a decode step's work does not
depend on the cache's values (the attention kernels read each sequence's keys up to its
length, the XLA attention the whole cache). The benchmark's own BF16 params stay on the
device beside the budget.

`--budget_context` takes several lengths, one fixed-memory case each (GPU preset: 8k and 32k;
the first recorded as `fixed_memory`, the others as `fixed_memory_{k}k`). Long context
(`--long_context`, 0 skips it; GPU preset 32k): every policy at `--key_batch` sequences of
that many tokens, decoded as in the fixed-memory case. Both report each case's bytes per
decode step (KV at the turn's mean length) and their fraction of the measured bandwidths.

Reference (`--transformers`, `--transformers_batches`): the same params exported with
`trace_jax.io.hf.save_hf_checkpoint`, loaded into `transformers.Qwen3MoeForCausalLM` (BF16,
its default attention and experts implementations; torch device from env TRACE_TORCH_DEVICE,
else cuda when available), greedy `generate` of exactly `--new_tokens` tokens
(min_new_tokens = max_new_tokens; the output length is checked) on the same prompts, timed
after one warm-up call; `first_token_agreement`: the fraction of its first greedy tokens equal
to the bf16 engine's at that batch (a check that the export is the same model).

Top-level plain numbers (`--key_batch`, default 64 on the GPU preset; the cases of
`--key_impl`, default "kernel"):
`fp4_over_bf16_fixed_batch`, `fp8_over_bf16_fixed_batch`, `fp4_trace_over_fp4_rtn_b{B}`,
`decode_bandwidth_fraction` (bf16 kernel, of read bandwidth; `_copy`: of copy bandwidth),
`fp4_over_bf16_fixed_memory` (+ `_sequences`; `_32k`, `_32k_sequences` per further
context; `fp4_trace_over_fp4_rtn_fixed_memory{,_32k}`), `fp4_over_bf16_long_context`,
`fp4_trace_over_fp4_rtn_long_context`, `bf16_over_transformers`,
`fp4_over_transformers`, `compile_s_max` and `compile_s_{L}_layers` (slowest program).

Model (GPU preset): a random Qwen3-MoE of hidden 2048, 32 query / 4 KV heads of 128, 64
experts top-8 of width 768, vocab 32768, `--layers` decoder layers (8: 2.70B parameters);
prefill's grouped matmuls on the Pallas grouped GEMMs (`moe_impl="kernel"`).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import flags

from experiments import common
from experiments.bench import profiling, rollout_transformers
from experiments.bench.rollout_bytes import (
  budget_plan,
  expected_touched,
  step_bytes,
)

FLAGS = flags.FlagValues()
flags.DEFINE_enum("preset", "h200", ["h200", "cpu"], "Model and batch sizes.", flag_values=FLAGS)
flags.DEFINE_list("policies", ["bf16", "fp4_rtn", "fp4_trace"], "Forwards of the rollout.",
                  flag_values=FLAGS)
flags.DEFINE_list("impls", ["xla", "kernel"],
                  "decode_impl values (and fp8_gemm's, for fp8_unified), each optionally with "
                  "`+unrolled` (scan_layers=False), `+unroll<N>` (scan_unroll=N) and "
                  "`+sync<N>` (decode_steps_per_sync=N), `+moetriton` / `+moewgmma` "
                  "(decode_moe_kernel), `+attnfused` / `+attntriton` / `+attnwgmma` "
                  "(decode_attention), `+kvappend` / `+kvxla` (kv_write), timed beside the "
                  "plain impl; "
                  "\"kernel_bytes\": "
                  "decode_impl kernel with packed NVFP4 codes held as bytes instead of words "
                  "(fp4_codes=\"bytes\"), for the side-by-side ratio.",
                  flag_values=FLAGS)
flags.DEFINE_list("batches", [], "Batch sizes (default per preset).", flag_values=FLAGS)
flags.DEFINE_list("cases", [], "Only these policy:impl:batch cases (default: all).",
                  flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Decoder layers (0: per preset).", flag_values=FLAGS)
flags.DEFINE_boolean("scan_layers", True, "Layers under lax.scan (False: unrolled, every layer "
                     "compiled apart).", flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 128, "Prompt tokens.", flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 128, "Generated tokens per sequence.", flag_values=FLAGS)
flags.DEFINE_integer("reps", 3, "Timed calls per case.", flag_values=FLAGS)
flags.DEFINE_integer("warmup_calls", None, "Untimed calls per case after the first (compiling) "
                     "one (default per preset: 1 on the GPU, where XLA's pinned host pool for "
                     "the records grows over the first two calls; 0 on CPU).",
                     flag_values=FLAGS)
flags.DEFINE_enum("records_drain", "overlap", ["overlap", "each"],
                  "Engines that record: `overlap` lets a call's records travel to the host "
                  "while the next call decodes (as a rollout loop does); `each` waits for them "
                  "at the end of every call, so no transfer overlaps a decode.",
                  flag_values=FLAGS)
flags.DEFINE_integer("key_batch", 0, "Batch of the top-level plain-number keys (0: per preset).",
                     flag_values=FLAGS)
flags.DEFINE_string("key_impl", "kernel", "The --impls entry of the top-level plain-number keys "
                    "(e.g. kernel+unroll4+sync4).", flag_values=FLAGS)
flags.DEFINE_float("budget_gb", None, "Fixed memory budget (GB, 1e9 bytes) for weights + KV "
                   "cache (0: skip the case; default per preset).", flag_values=FLAGS)
flags.DEFINE_list("budget_context", None, "Tokens per sequence (cache length) of each "
                  "fixed-memory case: one case per entry (default per preset).",
                  flag_values=FLAGS)
flags.DEFINE_integer("long_context", None, "Cache length of the long-context case: --key_batch "
                     "sequences of this many tokens, every policy (0: skip; default per "
                     "preset).", flag_values=FLAGS)
flags.DEFINE_integer("budget_max_batch", None, "Largest batch timed in the fixed-memory case "
                     "(default per preset).", flag_values=FLAGS)
flags.DEFINE_list("budget_policies", None, "Policies of the fixed-memory case (default per "
                  "preset; GPU: --policies).", flag_values=FLAGS)
flags.DEFINE_string("budget_impl", "kernel", "The fixed-memory case's decode impl, an --impls "
                    "entry (options included).",
                    flag_values=FLAGS)
flags.DEFINE_boolean("transformers", None, "HF transformers generate (BF16) as a reference "
                     "(default per preset).", flag_values=FLAGS)
flags.DEFINE_list("transformers_batches", [], "Batches of the transformers reference (default: "
                  "--key_batch).", flag_values=FLAGS)
flags.DEFINE_float("budget_s", 0, "Skip the remaining cases after this many seconds (0: none).",
                   flag_values=FLAGS)
flags.DEFINE_string("json_out", "", "JSON output path ('' = none).", flag_values=FLAGS)
flags.DEFINE_string("profile_dir", "", "Profile one more call of every fixed-batch case into "
                    "<dir>/<case> (and of every fixed-memory case into <dir>/budget_<policy>) "
                    "and print where its device time goes, per generated token ('' = no "
                    "profile).", flag_values=FLAGS)
flags.DEFINE_integer("profile_top", 25, "Kernels listed per profiled case (the JSON keeps "
                     "them too).", flag_values=FLAGS)
flags.DEFINE_string("profile_timeline", "", "With --profile_dir: also print each profiled "
                    "case's host and device events around the N-th host event named ANCHOR..., "
                    "as ANCHOR:N (e.g. cuGraphLaunch:40; '' = none).", flag_values=FLAGS)

def impl_options(impl: str) -> tuple[str, dict[str, Any]]:
  """An `--impls` entry -> (its decode_impl, the ModelConfig fields it sets): "kernel_bytes"
  decodes with "kernel" and fp4_codes="bytes"; `+unrolled` sets scan_layers=False,
  `+unroll<N>` scan_unroll=N,
  `+sync<N>` decode_steps_per_sync=N, `+moetriton` / `+moewgmma` decode_moe_kernel,
  `+attnfused` / `+attntriton` / `+attnwgmma` decode_attention, `+kvappend` / `+kvxla`
  kv_write "kernel" / "xla"."""
  from trace_jax.model.config import DECODE_IMPLS

  base, *mods = impl.split("+")
  decode_impl = "kernel" if base == "kernel_bytes" else base
  if decode_impl not in DECODE_IMPLS:
    raise ValueError(f"--impls entry {impl!r}: {base!r} is not one of {DECODE_IMPLS} or "
                     "kernel_bytes")
  fields: dict[str, Any] = {"fp4_codes": "bytes"} if base == "kernel_bytes" else {}
  for mod in mods:
    if mod == "unrolled":
      fields["scan_layers"] = False
    elif mod.startswith("unroll") and mod[6:].isdigit() and int(mod[6:]) >= 1:
      fields["scan_unroll"] = int(mod[6:])
    elif mod.startswith("sync") and mod[4:].isdigit() and int(mod[4:]) >= 1:
      fields["decode_steps_per_sync"] = int(mod[4:])
    elif mod in ("moetriton", "moewgmma"):
      fields["decode_moe_kernel"] = mod[3:]
    elif mod in ("attnfused", "attntriton", "attnwgmma"):
      fields["decode_attention"] = mod[4:]
    elif mod in ("kvappend", "kvxla"):
      fields["kv_write"] = "kernel" if mod == "kvappend" else "xla"
    else:
      raise ValueError(f"--impls entry {impl!r}: options are +unrolled, +unroll<N>, "
                       f"+sync<N> (N >= 1), +moetriton, +moewgmma, +attnfused, +attntriton, "
                       f"+attnwgmma, +kvappend and +kvxla, got +{mod}")
  return decode_impl, fields


def _check_impls(impls: list[str]) -> bool:
  for impl in impls:
    try:
      impl_options(impl)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from e
  return True


flags.register_validator("impls", _check_impls, flag_values=FLAGS)
for _name in ("key_impl", "budget_impl"):
  flags.register_validator(_name, lambda v: _check_impls([v]), flag_values=FLAGS)
flags.register_validator(
    "profile_timeline", lambda v: not v or bool(re.fullmatch(r".+:-?\d+", v)),
    "--profile_timeline must be ANCHOR:N (e.g. cuGraphLaunch:40)", flag_values=FLAGS)

PRESETS = {
    "h200": dict(model=dict(vocab_size=32768, hidden_size=2048, num_hidden_layers=8,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                            max_position_embeddings=4096, moe_impl="kernel"),
                 batches=(8, 64, 256), key_batch=64,
                 # every sequence FP4 fits in 60 GB decodes at once (1457; a cap of 512 ran a
                 # third of FP4's sequences)
                 budget_gb=60.0, budget_context=(8192, 32768), budget_max_batch=2048,
                 budget_policies=None, long_context=32768, transformers=True,
                 warmup_calls=1),
    # Budget: 1.6 MB holds the BF16 weights (1.12 MB) and 3 sequences of 256 tokens, FP4 7;
    # fixed memory for two policies only (each FP4 program compiles for ~15 s on CPU).
    "cpu": dict(model=dict(vocab_size=256, hidden_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                           max_position_embeddings=512), batches=(4,), key_batch=4,
                budget_gb=0.0016, budget_context=(256,), budget_max_batch=8,
                budget_policies=("bf16", "fp4_rtn"), long_context=0, transformers=False,
                warmup_calls=0),
}


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


# ----------------------------------------------------------------------------- cases

def make_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
  """The benchmark's prompts (the same for every policy and for transformers)."""
  return np.random.default_rng(0).integers(1, vocab, (batch, length)).tolist()


def _engine(params: Any, config: Any, batch: int) -> tuple[Any, float]:
  from trace_jax.rollout.engine import InProcessEngine

  t0 = time.perf_counter()
  engine = InProcessEngine(params, config, max_batch=batch,
                           record_guidance=config.forward.guided,
                           record_routing=config.forward.guided)
  return engine, time.perf_counter() - t0


def _timed(call: Callable[[], float], reps: int) -> dict[str, Any]:
  """first_call_s, warmup_calls_s (`--warmup_calls` untimed calls after it), median_s of
  `reps` calls and compile_s (first minus median) of `call`, which returns the seconds of the
  work it timed."""
  first = call()
  warm = [call() for _ in range(_preset("warmup_calls"))]
  med = float(np.median([call() for _ in range(max(reps, 1))]))
  return {"first_call_s": first, "warmup_calls_s": warm, "median_s": med,
          "compile_s": max(first - med, 0.0)}


def _profiled(call: Callable[[], float], log_dir: str, title: str) -> dict[str, Any]:
  """One more `call` traced into log_dir: where its device time goes per generated token
  (`profiling.summarize`), printed under `title`."""
  with profiling.trace(log_dir):
    call()
  summary = profiling.summarize(log_dir, steps=FLAGS.new_tokens, top=FLAGS.profile_top)
  print(profiling.format_summary(summary, title), flush=True)
  return summary


def run_case(params: Any, config: Any, batch: int, reps: int, name: str
             ) -> tuple[dict[str, Any], list]:
  """A fixed-batch case `name` (policy:impl:batch): (its numbers, the first generated token of
  each sequence)."""
  import jax

  from trace_jax.rollout.protocol import SamplingParams

  engine, init_s = _engine(params, config, batch)
  prompts = make_prompts(batch, FLAGS.prompt_len, config.vocab_size)
  sp = SamplingParams(max_new_tokens=FLAGS.new_tokens, temperature=0.0)
  out: list[Any] = []
  emits: list[tuple[float, int]] = []  # per call: seconds and bytes of taking records off

  generate_s: list[float] = []  # per call: the generate call alone (no records drained)

  def call() -> float:
    e0, b0 = engine.emit_seconds, engine.emit_bytes
    t0 = time.perf_counter()
    out[:] = engine.generate(prompts, sp)
    generate_s.append(time.perf_counter() - t0)
    emits.append((engine.emit_seconds - e0, engine.emit_bytes - b0))
    if FLAGS.records_drain == "each" and emits[-1][1]:
      _ = engine.last_guidance  # waits for this call's records
    return time.perf_counter() - t0

  r = _timed(call, reps)
  timed = 1 + len(r["warmup_calls_s"])  # the calls before the timed ones
  r["generate_s"] = float(np.median(generate_s[timed:]))
  # What a learner pays per weight update: the engine's weights made again (compiled above).
  t0 = time.perf_counter()
  engine.update_weights(params)
  jax.block_until_ready((engine.experts, engine.layers))
  r["update_weights_s"] = time.perf_counter() - t0
  per_call = r["median_s"]
  if emits[-1][1]:
    # Records: the engine starts their copy to the host and returns; the copy overlaps the
    # next call's decode. What is still in flight after the last timed call (read back here,
    # as a consumer would) is shared over the timed calls.
    t0 = time.perf_counter()
    assert engine.last_guidance is not None
    r["records_drain_s"] = time.perf_counter() - t0
    per_call += r["records_drain_s"] / max(reps, 1)
    r.update(emit_s_per_call=float(np.median([e for e, _ in emits[timed:]])),
             emit_bytes_per_call=emits[-1][1], emit_s_calls=[e for e, _ in emits])
    r["emit_fraction"] = r["emit_s_per_call"] / per_call
  tokens = sum(len(s.tokens) for s in out)
  if tokens != batch * FLAGS.new_tokens:  # greedy without stop ids: every row runs to the end
    raise RuntimeError(f"{config.policy}: generated {tokens} tokens, expected {batch} x "
                       f"{FLAGS.new_tokens}")
  r.update(engine_init_s=init_s, tokens=tokens, tokens_per_s=tokens / per_call,
           tokens_per_seq=tokens / batch)
  if FLAGS.profile_dir:
    log_dir = os.path.join(FLAGS.profile_dir, re.sub(r"[:+]", "_", name))
    r["profile"] = _profiled(call, log_dir, f"{name}, per generated token (prefill amortized)")
    if FLAGS.profile_timeline:
      anchor, _, index = FLAGS.profile_timeline.rpartition(":")
      print(f"timeline of {name} at the {index}th {anchor}:", flush=True)
      print(profiling.format_timeline(profiling.timeline(log_dir, anchor, int(index))),
            flush=True)
  return r, [s.tokens[0] for s in out]


def run_budget_case(params: Any, config: Any, budget_bytes: float, context: int, max_batch: int,
                    reps: int) -> dict[str, Any]:
  """The fixed-memory case of one policy: sequences of `context` tokens fitting next to the
  engine's weights, and the decode tokens/s at that many (at most `max_batch`) of one engine
  session turn per call (`InProcessEngine.extend`: the pending token fed, then `--new_tokens`
  decoded) over caches of `context` tokens; the turn's records go to the host as it ends."""
  import jax

  from trace_jax import model as model_lib
  from trace_jax.rollout import engine as engine_lib
  from trace_jax.rollout.protocol import SamplingParams

  new = FLAGS.new_tokens
  if context < new + 2:
    raise ValueError(f"--budget_context {context} must exceed --new_tokens {new} + 1")
  config = config.replace(max_position_embeddings=max(config.max_position_embeddings,
                                                      engine_lib.bucket(context)))
  engine, init_s = _engine(params, config, max_batch)
  r = budget_plan(engine, budget_bytes, context, new_tokens=new)
  r["engine_init_s"] = init_s
  r["plan"] = engine.plan.as_dict()  # what ran (the fields an impl entry leaves "auto")
  if not r["sequences"]:
    return r
  b = min(r["sequences"], max_batch)
  per_seq = r["kv_bytes_per_seq"] + r["record_bytes_per_seq"]
  pending = np.random.default_rng(0).integers(1, config.vocab_size, b).tolist()
  sp = [SamplingParams(max_new_tokens=new, temperature=0.0)] * b
  out: list[Any] = []

  def call() -> float:
    # A session of b rows whose caches hold `context - new - 2` tokens (zeros: the decode's
    # work does not depend on them), as `open_session` makes it but unpadded; its earlier
    # turns' records would be on the host.
    session = engine_lib.Session(
        n=b, batch=b, total=context, cache=model_lib.init_cache(config, b, context),
        layout=engine.record_layout(), lens=np.full(b, context - new - 2, np.int32),
        pending=list(pending))
    jax.block_until_ready(session.cache)
    t0 = time.perf_counter()
    out[:] = engine.extend(session, list(range(b)), [[]] * b, sp)
    dt = time.perf_counter() - t0
    del session
    return dt

  r.update(_timed(call, reps))
  tokens = sum(len(s.tokens) for s in out)
  if tokens != b * new:
    raise RuntimeError(f"fixed-memory decode generated {tokens} tokens, expected {b} x {new}")
  r.update(batch=b, tokens=tokens, tokens_per_s=tokens / r["median_s"],
           total_bytes=r["weight_bytes"] + b * per_seq)
  if FLAGS.profile_dir:
    r["profile"] = _profiled(call, os.path.join(FLAGS.profile_dir, f"budget_{config.policy}"),
                             f"budget:{config.policy} at batch {b}, {context}-token caches, "
                             "per generated token")
  return r


# ----------------------------------------------------------------------------- driver

def _preset(name: str) -> Any:
  value = FLAGS[name].value
  return PRESETS[FLAGS.preset][name] if value is None else value


def _print_case(name: str, r: dict[str, Any]) -> None:
  """A decode case's line: tokens/s, first call and compile, bytes per step and their fraction
  of the read and copy rates; the engine's set-up; an fp4_trace case's records."""
  nbytes = r["step_bytes"]
  print(f"  {name:<22} {r['tokens_per_s']:>10,.0f} tok/s  first call "
        f"{r['first_call_s']:6.1f} s (compile {r['compile_s']:6.1f} s)  "
        f"{_gb(nbytes)}/step -> {100 * r['read_fraction']:4.1f}% of read, "
        f"{100 * r['copy_fraction']:4.1f}% of copy bandwidth", flush=True)
  print(f"  {'':<22} engine made in {r['engine_init_s']:.1f} s (weights prepared, their "
        f"program compiled), weights updated in {r['update_weights_s']:.2f} s", flush=True)
  if "emit_s_per_call" in r:
    print(f"  {'':<22} records: {_gb(r['emit_bytes_per_call'])} per call, "
          f"{1e3 * r['emit_s_per_call']:.1f} ms of each call to start their transfer "
          f"({100 * r['emit_fraction']:.1f}%), {1e3 * r['records_drain_s']:.1f} ms to "
          f"drain the last (counted in tok/s); generate calls alone "
          f"{1e3 * r['generate_s']:.1f} ms (records drained: {FLAGS.records_drain}); "
          f"the start, call by call: "
          f"{', '.join(f'{1e3 * e:.1f}' for e in r['emit_s_calls'])} ms", flush=True)


def run_bench() -> dict[str, Any]:
  import jax

  from trace_jax import model as model_lib

  p = PRESETS[FLAGS.preset]
  fields = dict(p["model"], dtype="bfloat16")
  if FLAGS.layers:
    fields["num_hidden_layers"] = FLAGS.layers
  fields["scan_layers"] = FLAGS.scan_layers
  base = model_lib.tiny(**fields)
  batches = [int(b) for b in FLAGS.batches] or list(p["batches"])
  key_batch = FLAGS.key_batch or p["key_batch"]
  res: dict[str, Any] = {**common.device_description(), **common.bandwidth_gbps(),
                         "model": fields, "layers": base.num_hidden_layers,
                         "prompt_len": FLAGS.prompt_len, "new_tokens": FLAGS.new_tokens,
                         "key_batch": key_batch, "key_impl": FLAGS.key_impl, "cases": {}}
  print(f"bench_rollout: {res['backend']} {res['device_kind']}, copy {res['copy_gbps']:.0f} "
        f"GB/s, read {res['read_gbps']:.0f} GB/s; {base.num_hidden_layers} layers", flush=True)
  params = model_lib.init_params(base, jax.random.key(0), param_dtype="bfloat16")
  res["parameters"] = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
  start = time.perf_counter()

  def over_budget() -> bool:
    return bool(FLAGS.budget_s) and time.perf_counter() - start > FLAGS.budget_s

  first_tokens: dict[str, list] = {}
  for policy in FLAGS.policies:
    for impl in FLAGS.impls:
      for batch in batches:
        name = f"{policy}:{impl}:{batch}"
        if FLAGS.cases and name not in FLAGS.cases:
          continue
        if over_budget():
          res["cases"][name] = {"skipped": "budget"}
          continue
        config = _impl_case(base, policy, impl)
        r, first_tokens[name] = run_case(params, config, batch, FLAGS.reps, name)
        _with_bandwidth(r, config, batch, FLAGS.prompt_len + r["tokens_per_seq"] / 2, res)
        res["cases"][name] = r
        _print_case(name, r)

  if _preset("transformers"):
    hf_batches = [int(b) for b in FLAGS.transformers_batches] or [key_batch]
    if over_budget():
      res["transformers"] = {"skipped": "budget"}
    else:
      res["transformers"] = rollout_transformers.run(
          params, base, hf_batches, first_tokens,
          lambda b: make_prompts(b, FLAGS.prompt_len, base.vocab_size), FLAGS.new_tokens,
          lambda call: _timed(call, FLAGS.reps))

  budget_gb = _preset("budget_gb")
  for i, context in enumerate(int(c) for c in _preset("budget_context")):
    if not budget_gb:
      break
    res[fixed_memory_key(context, i == 0)] = run_fixed_memory(
        params, base, res, budget_gb, context, over_budget)
  if _preset("long_context"):
    res["long_context"] = run_long_context(params, base, res, _preset("long_context"),
                                           key_batch, over_budget)

  res["ratios"] = ratios(res["cases"])
  for k, v in res["ratios"].items():
    print(f"  {k}: {v:.3f}")
  keys = summary(res)
  res.update(keys)
  for k, v in keys.items():
    print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
  return res


def fixed_memory_key(context: int, first: bool) -> str:
  """The record's key of a fixed-memory case: "fixed_memory" for the first context, then
  "fixed_memory_{k}k" (k = context / 1024)."""
  return "fixed_memory" if first else f"fixed_memory_{context // 1024}k"


def _with_bandwidth(r: dict[str, Any], config: Any, b: int, context: float,
                    res: dict[str, Any]) -> None:
  """A timed case's bytes per decode step at `b` sequences (KV at the mean `context`) and
  their rate against the bandwidths measured in this process."""
  if "tokens_per_s" not in r:
    return
  touched = expected_touched(config.num_experts, config.num_experts_per_tok, b)
  nbytes = step_bytes(config, b, context, touched)
  rate = nbytes * r["tokens_per_s"] / b / 1e9
  r.update(step_bytes=nbytes, read_fraction=rate / res["read_gbps"],
           copy_fraction=rate / res["copy_gbps"])


def run_fixed_memory(params: Any, base: Any, res: dict[str, Any], budget_gb: float,
                     context: int, over_budget: Callable[[], bool]) -> dict[str, Any]:
  """Every budget policy's fixed-memory case at `context` tokens per sequence."""
  cap = _preset("budget_max_batch")
  fm: dict[str, Any] = {"budget_gb": budget_gb, "context": context, "max_batch": cap,
                        "impl": FLAGS.budget_impl, "cases": {}}
  print(f"  fixed memory: {budget_gb:g} GB for weights + KV cache (packed NVFP4 under FP4 "
        f"policies with decode impl kernel, else BF16) + records, {context}-token sequences, "
        f"decode impl {FLAGS.budget_impl}, batch at most {cap}", flush=True)
  for policy in _preset("budget_policies") or FLAGS.policies:
    if over_budget():
      fm["cases"][policy] = {"skipped": "budget"}
      continue
    config = _impl_case(base, policy, FLAGS.budget_impl)
    r = fm["cases"][policy] = run_budget_case(params, config, budget_gb * 1e9, context, cap,
                                              FLAGS.reps)
    _with_bandwidth(r, config, r.get("batch", 0), context - FLAGS.new_tokens / 2, res)
    head = (f"  budget:{policy:<15} weights {_gb(r['weight_bytes'])}, "
            f"{_gb(r['kv_bytes_per_seq'] + r['record_bytes_per_seq'])}/sequence "
            f"(records {_gb(r['record_bytes_per_seq'])} on the device, "
            f"{_gb(r['host_record_bytes_per_seq'])} on the host): {r['sequences']} fit")
    if "skipped" in r:
      print(f"{head}; not timed: {r['skipped']}", flush=True)
    else:
      print(f"{head}; at batch {r['batch']} {r['tokens_per_s']:>10,.0f} tok/s  first call "
            f"{r['first_call_s']:6.1f} s (compile {r['compile_s']:6.1f} s), "
            f"{100 * r['read_fraction']:4.1f}% of read bandwidth", flush=True)
  return fm


def run_long_context(params: Any, base: Any, res: dict[str, Any], context: int, batch: int,
                     over_budget: Callable[[], bool]) -> dict[str, Any]:
  """Every policy at `batch` sequences of `context` tokens (the fixed-memory case's decode
  with no budget: caches of zeros, `--new_tokens` decoded in one session turn)."""
  lc: dict[str, Any] = {"context": context, "batch": batch, "impl": FLAGS.budget_impl,
                        "cases": {}}
  print(f"  long context: batch {batch}, {context}-token caches, decode impl "
        f"{FLAGS.budget_impl}", flush=True)
  for policy in FLAGS.policies:
    if over_budget():
      lc["cases"][policy] = {"skipped": "budget"}
      continue
    config = _impl_case(base, policy, FLAGS.budget_impl)
    r = lc["cases"][policy] = run_budget_case(params, config, 1e30, context, batch, FLAGS.reps)
    r.pop("sequences")  # what a 1e30-byte budget would hold: not a figure
    _with_bandwidth(r, config, r["batch"], context - FLAGS.new_tokens / 2, res)
    print(f"  long:{policy:<18} {r['tokens_per_s']:>10,.0f} tok/s  first call "
          f"{r['first_call_s']:6.1f} s (compile {r['compile_s']:6.1f} s), "
          f"{100 * r['read_fraction']:4.1f}% of read bandwidth", flush=True)
  return lc


def _impl_case(base: Any, policy: str, impl: str) -> Any:
  """The config of `policy` under an `--impls` entry. "kernel": the decode kernels, and FP8
  GEMMs on the Pallas kernel with FP8 weights made once per update; "xla": the references;
  the entry's options as config fields (`impl_options`)."""
  decode_impl, fields = impl_options(impl)
  return base.replace(policy=policy, decode_impl=decode_impl, fp8_gemm=decode_impl, **fields)


def ratios(cases: dict[str, Any]) -> dict[str, float]:
  """tokens/s ratios side by side: each FP4 case over BF16 and fp4_trace over fp4_rtn (same
  impl, batch), kernel over XLA (same policy, batch), an impl with options (`+unroll2`) over
  the plain one. An impl's `+` is `_` in the keys."""
  out = {}
  tps = {k: v["tokens_per_s"] for k, v in cases.items() if "tokens_per_s" in v}
  for k, v in tps.items():
    policy, impl, batch = k.split(":")
    key = impl.replace("+", "_")
    bf16 = tps.get(f"bf16:{impl}:{batch}")
    if policy != "bf16" and bf16:
      out[f"{policy}_over_bf16_{key}_b{batch}"] = v / bf16
    rtn = tps.get(f"fp4_rtn:{impl}:{batch}")
    if policy == "fp4_trace" and rtn:
      out[f"fp4_trace_over_fp4_rtn_{key}_b{batch}"] = v / rtn
    if impl == "kernel_bytes" and f"{policy}:kernel:{batch}" in tps:
      out[f"kernel_words_over_bytes_{policy}_b{batch}"] = tps[f"{policy}:kernel:{batch}"] / v
    plain = impl.split("+")[0]
    if plain != impl and f"{policy}:{plain}:{batch}" in tps:
      out[f"{policy}_{key}_over_{plain}_b{batch}"] = (
          v / tps[f"{policy}:{plain}:{batch}"])
    xla = tps.get(f"{policy}:xla:{batch}")
    if impl == "kernel" and xla:
      out[f"kernel_over_xla_{policy}_b{batch}"] = v / xla
  return out


def summary(res: dict[str, Any]) -> dict[str, Any]:
  """The record's top-level plain numbers, from the cases that ran: `key_impl`
  (default kernel) at `key_batch` for the fixed-batch ratios, each policy at its own fit for
  fixed memory."""
  kb, ki = res["key_batch"], res.get("key_impl", "kernel")
  cases = res.get("cases", {})
  fm = res.get("fixed_memory", {}).get("cases", {})
  hf = res.get("transformers", {}).get("cases", {})

  def get(d: dict[str, Any], name: str, key: str = "tokens_per_s") -> float | None:
    return d.get(name, {}).get(key)

  out: dict[str, Any] = {}

  def ratio(key: str, a: float | None, b: float | None) -> None:
    if a and b:
      out[key] = a / b

  bf16, fp4 = get(cases, f"bf16:{ki}:{kb}"), get(cases, f"fp4_rtn:{ki}:{kb}")
  ratio("fp4_over_bf16_fixed_batch", fp4, bf16)
  ratio("fp8_over_bf16_fixed_batch", get(cases, f"fp8_unified:{ki}:{kb}"), bf16)
  ratio(f"fp4_trace_over_fp4_rtn_b{kb}", get(cases, f"fp4_trace:{ki}:{kb}"), fp4)
  for key, field in (("decode_bandwidth_fraction", "read_fraction"),
                     ("decode_bandwidth_fraction_copy", "copy_fraction")):
    v = get(cases, f"bf16:{ki}:{kb}", field)
    if v:
      out[key] = v
  for key in [k for k in res if k.startswith("fixed_memory")]:
    c = res[key].get("cases", {})
    tail = key[len("fixed_memory"):]
    ratio(f"fp4_over_bf16_fixed_memory{tail}", get(c, "fp4_rtn"), get(c, "bf16"))
    ratio(f"fp4_over_bf16_fixed_memory{tail}_sequences", get(c, "fp4_rtn", "sequences"),
          get(c, "bf16", "sequences"))
    ratio(f"fp8_over_bf16_fixed_memory{tail}", get(c, "fp8_unified"), get(c, "bf16"))
    ratio(f"fp4_trace_over_fp4_rtn_fixed_memory{tail}", get(c, "fp4_trace"), get(c, "fp4_rtn"))
  lc = res.get("long_context", {}).get("cases", {})
  ratio("fp4_over_bf16_long_context", get(lc, "fp4_rtn"), get(lc, "bf16"))
  ratio("fp4_trace_over_fp4_rtn_long_context", get(lc, "fp4_trace"), get(lc, "fp4_rtn"))
  ratio("bf16_over_transformers", bf16, get(hf, str(kb)))
  ratio("fp4_over_transformers", fp4, get(hf, str(kb)))
  compiles = {f"budget:{k}" if src is fm else k: v["compile_s"]
              for src in (cases, fm) for k, v in src.items() if "compile_s" in v}
  compiles.update({f"long:{k}": v["compile_s"] for k, v in lc.items() if "compile_s" in v})
  if compiles:
    slowest = max(compiles, key=compiles.get)
    out.update({"compile_s_max": compiles[slowest], "compile_s_max_case": slowest,
                f"compile_s_{res['layers']}_layers": compiles[slowest]})
  for key in ("engine_init_s", "update_weights_s"):  # the engine's weights, made / made again
    made = {k: v[key] for k, v in cases.items() if key in v}
    if made:
      slowest = max(made, key=made.get)
      out.update({f"{key}_max": made[slowest], f"{key}_max_case": slowest})
  return out


def main(argv: Sequence[str]) -> dict[str, Any] | None:
  if not common.parse_flags(FLAGS, argv):
    return None
  common.set_gpu_memory_env()
  return common.finish(run_bench(), FLAGS)


if __name__ == "__main__":
  main(sys.argv)
