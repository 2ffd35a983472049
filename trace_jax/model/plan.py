"""The kernel plan: which implementation runs each operation of a model's programs.

One frozen `KernelPlan` says, for every operation whose implementation can be chosen, which
one runs. It is resolved once from a `ModelConfig` and a `Backend` where a program is built
(the rollout engine, `model.forward` for the training steps and scoring) and read from there
by the model's modules, which pass each kernel the small config object it takes. No module
keeps a switch of its own; a benchmark compares implementations by passing configs (plans).

A config chooses with `ModelConfig.plan` (a preset: "auto", "reference" or "invariant") and
per-operation fields of the same names as the plan's (`FIELDS`), each "auto" by default or
forced to one of its choices. "auto" takes the preset's value where the preset names one, else
the fastest measured implementation on the backend (docs/benchmarks.md):

| field             | Hopper      | elsewhere | what it selects                                |
|-------------------|-------------|-----------|------------------------------------------------|
| moe_impl          | mgpu (%)    | tiled     | grouped matmuls of training and prefill        |
| decode_impl       | kernel      | xla       | one-token decode steps (experts, projections,  |
|                   |             |           | lm_head, attention) on the decode kernels      |
| decode_moe_kernel | wgmma       | triton    | the packed NVFP4 experts' decode kernel        |
| fp4_codes         | words (GPU) | bytes     | packed NVFP4 codes' layout (weights, KV cache) |
| decode_attention  | fused (=)   | triton    | the kernel decode's attention over its cache   |
|                   |             |           | (packed NVFP4 or BF16)                         |
| kv_cache          | packed (*)  | dense     | NVFP4 forwards' KV cache: codes or values      |
| nvfp4_sites       | kernel (*)  | xla       | the rollout's unguided NVFP4 activation sites  |
| kv_write          | kernel (-)  | xla       | a kernel decode step's k/v sites (and records) |
|                   |             |           | and packed-cache write: site kernel + XLA's    |
|                   |             |           | scatters, or one kernel (`kernels.kv_append`)  |
| fp8_gemm          | wgmma (~)   | xla       | FP8 linears' block-scaled GEMMs: Triton's, or  |
|                   |             |           | wgmma (Mosaic GPU, `kernels.wgmma_fp8`)        |
| fp8_bwd_operands  | kernel (^)  | xla       | the FP8 backward's operands (the experts'      |
|                   |             |           | WGrad rows in 128-row tiles, transposed, 128x1 |
|                   |             |           | codes; the DGrad's weight codes transposed):   |
|                   |             |           | XLA's, or kernels (`kernels.fp8_tiles`)        |
| seq_attention     | cudnn (+)   | xla       | full-sequence attention (training, scoring,    |
|                   |             |           | prefill): fused flash attention or XLA's       |
| layer_loop        | unrolled (!)| scan      | every forward's layer loop: each run of layers |
|                   |             |           | one `lax.scan` or that scan unrolled whole     |
| fake_quant        | kernel (&)  | xla       | NVFP4 training forwards' fake quantizers (the  |
|                   |             |           | expert weights, the guided and the RTN         |
|                   |             |           | activation sites): XLA's or one kernel each    |

(*) with decode_impl "kernel" on any backend: the packed cache and the site kernel are the
kernel decode's. (=) the single pass (online softmax, no scores in memory): over a dense (BF16)
cache Triton's, over the packed NVFP4 cache `kernels.wgmma_flash` on a GPU with the Mosaic GPU
API ("triton", the exact pair, elsewhere on Hopper). On the H100 the single pass took
0.78-0.98x the Triton pair's time over a BF16 cache at 8k-32k contexts and 0.71-0.88x the
wgmma pair's over the packed cache (docs/benchmarks.md). "wgmma" forces the exact pair
(`attend`'s probabilities) with the wgmma kernels where they run.
(-) where the plan has the packed cache and the site kernel, on Hopper: `kernels.kv_append`
writes the same bits as the site kernel and XLA's scatters, in 40 fewer kernels per 8-layer
step (+0.2-0.5% tokens/s on the H100). (+) for bf16 compute with head_dim a multiple of 8
up to 128 (cuDNN's fused attention). "fp4_codes" is "words" on any GPU with Triton's inline
assembly.
(~) on a GPU with the Mosaic GPU API, else "kernel" (Triton's); operands `wgmma_fp8` does not
take (WGrad's 128x1 groups) go to Triton's kernel either way. On the H100 at Qwen3-30B-A3B
width the wgmma kernel took the experts' FP8 GEMMs 1.1-2.2x faster than Triton's and the
fp8_unified training step from 1.34x to 1.21x the BF16 step's time (docs/benchmarks.md).
(^) on Hopper (Triton's kernels): XLA fuses the WGrad rows' gather and transpose into loop
fusions that read across the rows' stride, quantizes that copy again, and fuses the weights'
byte transposes with their neighbours; the kernels read each tile once and write its codes.
On the H100 at Qwen3-30B-A3B width they took the fp8_unified+fp8bwd training step from 102.2
to 77.5 ms at 4 layers (2.05x to 1.55x the BF16 step) and from 288.7 to 217.5 ms at 12
(docs/benchmarks.md).
(%) JAX's own Mosaic GPU grouped GEMM (`model.grouped`) for the forward and DGrad, with bf16
or f16 compute and widths that are multiples of its 64-column tiles (else "kernel", the Pallas
grouped GEMMs, for widths that are multiples of 16): on the H100 at Qwen3-30B-A3B width it took
the BF16 training step from 89.8 to 77.6 ms scanned and from 61.9 to 50.3 ms with every layer
its own call (docs/benchmarks.md).
"auto" falls back to the reference where the shapes or the forward rule a kernel out (e.g.
decode_impl "xla" under MXFP4 forwards, moe_impl "tiled" for widths not multiples of 16).
Where the code runs each choice: `model.grouped` (moe_impl), `kernels.fp4_moe` (decode_impl,
decode_moe_kernel, fp4_codes), `kernels.decode_attention` and `kernels.kv_cache`
(decode_attention, kv_cache), `kernels.kv_append` (kv_write), `kernels.nvfp4_act`
(nvfp4_sites; fake_quant through `model.precision`), `model.fp8_linear` (fp8_gemm,
fp8_bwd_operands), `model.attention` (seq_attention, through `kernels.attention_math`),
`model.transformer` (layer_loop). A resolved plan states what runs: `kv_cache`,
`nvfp4_sites` and `fake_quant` are "dense", "xla" and "xla" under forwards without NVFP4
sites, and `kv_write` "xla" without both the packed cache and the site kernel, whatever was
forced. The kernels and the reference compute the same values up to float32 summation order
(docs/numerics.md); cuDNN's attention also rounds its probabilities per key block rather than
once.

decode_attention "fused" is `kernels.flash_decode`'s single kernel: an online softmax with no
scores in memory, whose rounded probabilities are unnormalized, so it is not `attend`'s bits
even on CPU; "triton" and "wgmma" keep `attend`'s probabilities. On the GPU the trainer's
attention is cuDNN's, which also rounds unnormalized probabilities per key block: there the
fused kernel agreed with the trainer better than the exact pair (fp4_trace's |dlogp| 0.0076
against 0.0105 on the H100, docs/benchmarks.md), so forcing it over the packed cache trades
speed for a smaller mismatch.

(!) up to `UNROLLED_MAX_LAYERS` decoder layers, else "scan". Unrolled, the same scan body is
compiled once per layer, and XLA folds away the scan's stacking of the layers' weights, its
per-layer slices and its carried copies: on the H100 the BF16 training step at Qwen3 layer
width took 49.4 ms unrolled against 78.1 ms scanned (docs/benchmarks.md). It is the loop of
every forward, the rollout's prefill and decode steps as much as the trainer's, because the
rollout/trainer agreement needs both programs alike: in the RL loop a trainer unrolled
against a scanned rollout agreed with it far less (unguided code flips 13% against 1.4%,
docs/results.md), both unrolled as well as both scanned (1.26%). Compile time grows with
depth, hence the bound.

(&) "kernel": `kernels.nvfp4_act.qdq_rows` for the expert weights (each read once and written
once, its block scales made in registers, under the expert's second-level scale, gate and up
sharing theirs) and `guided_qdq_rows` for the activation sites that round under a compact
record (the RTN rows of expert_mid in the same kernel); Triton on the GPU, the interpreter
elsewhere; the same bits and straight-through gradients as XLA's quantizers. On a mesh the
weights (outside an expert-parallel body) take XLA's quantizer, which the SPMD partitioner
splits; the sites run per batch shard. On the H100 the fp4_trace training step at Qwen3 layer
width took 61.08 ms against 62.76 with XLA's quantizers, and compiled in 58 s against 91
(docs/benchmarks.md); the weight kernel runs at ~0.8 TB/s, bound by its integer arithmetic.

"invariant": the reference's fields, and every matmul, attention, norm, softmax and MoE
combine of the forward computed with sums in a fixed order (`kernels.invariant`), so a row's
result does not depend on the batch, the sequence or the cache length: the rollout's decode
and the trainer's full-sequence forward compute the same bits (`KernelPlan.invariant`). It
takes no kernel and no FP8 linears (their GEMMs sum in their own order).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax

from trace_jax.kernels import fp4_decode, grouped_gemm, wgmma_decode

AUTO = "auto"
# field -> its choices, the reference (XLA) implementation first.
FIELDS: dict[str, tuple[str, ...]] = {
    "moe_impl": ("tiled", "ragged_dot", "kernel", "mgpu"),
    "decode_impl": ("xla", "kernel"),
    "decode_moe_kernel": ("triton", "wgmma"),
    "fp4_codes": ("bytes", "words"),
    "decode_attention": ("triton", "wgmma", "fused"),
    "kv_cache": ("dense", "packed"),
    "nvfp4_sites": ("xla", "kernel"),
    "kv_write": ("xla", "kernel"),
    "fp8_gemm": ("xla", "kernel", "wgmma"),
    "fp8_bwd_operands": ("xla", "kernel"),
    "seq_attention": ("xla", "cudnn"),
    "layer_loop": ("scan", "unrolled"),
    "fake_quant": ("xla", "kernel"),
}
# Named plans: field -> value; the fields a preset leaves out are resolved per backend.
PRESETS: dict[str, Mapping[str, str]] = {
    "auto": {},
    "reference": {name: choices[0] for name, choices in FIELDS.items()},
    "invariant": {name: choices[0] for name, choices in FIELDS.items()},
}
INVARIANT = "invariant"  # the preset whose forward is row-invariant (`KernelPlan.invariant`)
# The deepest model whose layer loop "auto" unrolls on Hopper: unrolled, a program compiles
# each layer's body apart (6 layers of configs/small_h200.py: the RL loop's first fp4_trace
# step, which compiles the rollout's and the trainer's programs, took 75 s on the H100).
UNROLLED_MAX_LAYERS = 16
# SMs assumed where the device does not say (an H100/H200's).
DEFAULT_SM_COUNT = 132


@dataclasses.dataclass(frozen=True)
class Backend:
  """What the plan's "auto" depends on: the device platform ("cpu", "gpu", ...), its CUDA
  compute capability (major, minor) on a GPU, its SM count, and whether this jax has the
  kernels' GPU APIs (Mosaic GPU's wgmma kernels: `mosaic_gpu`; Triton inline assembly:
  `triton_asm`). Tests build one by hand; `current()` reads the default device."""
  platform: str
  compute_capability: tuple[int, int] | None = None
  sm_count: int = DEFAULT_SM_COUNT
  mosaic_gpu: bool = False
  triton_asm: bool = False

  @property
  def gpu(self) -> bool:
    return self.platform == "gpu"

  @property
  def hopper(self) -> bool:
    """An sm_90 GPU (H100, H200): the kernels' target."""
    return self.gpu and self.compute_capability is not None and self.compute_capability[0] == 9

  @classmethod
  def current(cls) -> Backend:
    """The default device's backend (`jax.devices()[0]`), read once per process."""
    return _current_backend()


@functools.cache
def _current_backend() -> Backend:
  device = jax.devices()[0]
  platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
  cc = getattr(device, "compute_capability", None)
  capability = tuple(int(p) for p in str(cc).split(".")[:2]) if cc else None
  sms = int(getattr(device, "core_count", 0) or 0) if platform == "gpu" else 0
  return Backend(platform=platform, compute_capability=capability,
                 sm_count=sms or DEFAULT_SM_COUNT,
                 mosaic_gpu=platform == "gpu" and wgmma_decode.available(),
                 triton_asm=platform == "gpu" and fp4_decode.ASM_AVAILABLE)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """The implementation of every operation (`FIELDS`; concrete values, never "auto"), the
  backend's SM count (the decode attention's launch shape), and whether the forward's sums
  run in a fixed order (`invariant`: the "invariant" preset, `kernels.invariant`). Hashable:
  programs take it as a static argument."""
  moe_impl: str
  decode_impl: str
  decode_moe_kernel: str
  fp4_codes: str
  decode_attention: str
  kv_cache: str
  nvfp4_sites: str
  fp8_gemm: str
  seq_attention: str = "xla"
  layer_loop: str = "scan"
  kv_write: str = "xla"
  fake_quant: str = "xla"
  fp8_bwd_operands: str = "xla"
  sm_count: int = DEFAULT_SM_COUNT
  invariant: bool = False

  def __post_init__(self):
    for name, choices in FIELDS.items():
      if getattr(self, name) not in choices:
        raise ValueError(f"KernelPlan: {name} must be one of {choices}, got "
                         f"{getattr(self, name)!r}")

  @property
  def grouped(self) -> str:
    """The grouped matmuls' implementation (`model.grouped`): "invariant" under the invariant
    plan, else `moe_impl`."""
    return INVARIANT if self.invariant else self.moe_impl

  @property
  def words(self) -> bool:
    """Whether packed NVFP4 codes are held as words per block (`fp4_codes`)."""
    return self.fp4_codes == "words"

  def as_dict(self) -> dict[str, Any]:
    """The plan as plain data (for a run's summary)."""
    return dataclasses.asdict(self)


def default_codes(backend: Backend | None = None) -> str:
  """"auto"'s `fp4_codes` on `backend` (default `Backend.current()`): "words" on a GPU with
  Triton's inline assembly (the GPU kernels' decoder), else "bytes" (the interpreter's)."""
  b = Backend.current() if backend is None else backend
  return "words" if b.gpu and b.triton_asm else "bytes"


def reference() -> KernelPlan:
  """The XLA reference plan (every field's first choice), on any backend."""
  return KernelPlan(**PRESETS["reference"])


def check(config: Any) -> list[str]:
  """One-line errors for a config's plan fields: `plan` a preset, each field "auto" or one
  of its choices, a forced moe_impl="kernel" on widths it takes."""
  errors = []
  if config.plan not in PRESETS:
    errors.append(f"plan must be one of {tuple(PRESETS)}, got {config.plan!r}")
  for name, choices in FIELDS.items():
    value = getattr(config, name)
    if value != AUTO and value not in choices:
      errors.append(f"{name} must be one of {(AUTO, *choices)}, got {value!r}")
  if config.plan == INVARIANT:
    errors += _invariant_errors(config)
  if config.moe_impl == "kernel" and not _moe_kernel_shapes(config):
    errors.append(f'moe_impl="kernel" needs hidden_size ({config.hidden_size}) and '
                  f"moe_intermediate_size ({config.moe_intermediate_size}) multiples of 16")
  if config.moe_impl == "mgpu" and not _mgpu_shapes(config):
    errors.append(f'moe_impl="mgpu" needs dtype bfloat16 or float16 (got {config.dtype}) and '
                  f"hidden_size ({config.hidden_size}) and moe_intermediate_size "
                  f"({config.moe_intermediate_size}) multiples of "
                  f"{grouped_gemm.MGPU_TILES['block_k']}")
  if config.seq_attention == "cudnn" and not _cudnn_attention_shapes(config):
    errors.append(f'seq_attention="cudnn" needs dtype bfloat16 (got {config.dtype}) and '
                  f"head_dim a multiple of 8 up to 128 (got {config.head_dim})")
  return errors


def _cudnn_attention_shapes(config: Any) -> bool:
  """What cuDNN's fused attention takes: bf16 inputs, head_dim a multiple of 8 up to 128."""
  h = config.head_dim
  return config.dtype == "bfloat16" and h % 8 == 0 and h <= 128


def _invariant_errors(config: Any) -> list[str]:
  """The invariant plan runs the reference (XLA) implementation of every operation, without
  FP8 linears."""
  errors = [f'plan="invariant" runs {name}="{choices[0]}", got {getattr(config, name)!r}'
            for name, choices in FIELDS.items() if getattr(config, name) not in (AUTO, choices[0])]
  try:
    fp8 = config.forward.fp8_linears
  except ValueError:  # an unknown policy: the config reports it
    fp8 = False
  if fp8:
    errors.append(f'plan="invariant" takes no FP8 linears (policy {config.policy!r})')
  return errors


def _moe_kernel_shapes(config: Any) -> bool:
  return config.hidden_size % 16 == 0 and config.moe_intermediate_size % 16 == 0


def _mgpu_shapes(config: Any) -> bool:
  """Whether moe_impl "mgpu" takes the config: bf16/f16 compute and every grouped product's K
  (hidden, expert width, twice it) a multiple of its 64-column tiles."""
  k = grouped_gemm.MGPU_TILES["block_k"]
  return (str(config.dtype) in ("bfloat16", "float16") and config.hidden_size % k == 0
          and config.moe_intermediate_size % k == 0)


def _moe_impl(b: Backend, config: Any) -> str:
  """moe_impl's "auto": JAX's Mosaic GPU grouped GEMM on Hopper where it takes the config, else
  the Pallas kernels on Hopper where the widths allow, else the tiled reference."""
  if b.hopper and b.mosaic_gpu and _mgpu_shapes(config):
    return "mgpu"
  return "kernel" if b.hopper and _moe_kernel_shapes(config) else "tiled"


def _decode_kernel_shapes(config: Any) -> bool:
  """Widths the decode kernels take: every matmul's N and K multiples of 16, head_dim a power
  of two >= 16 (the attention kernels)."""
  h = config.head_dim
  widths = (config.hidden_size, config.moe_intermediate_size,
            config.num_attention_heads * h, config.num_key_value_heads * h)
  return all(w % 16 == 0 for w in widths) and h >= 16 and h & (h - 1) == 0


def _decode_attention(hopper: bool, b: Backend, kv_cache: str) -> str:
  """decode_attention's "auto" (the module docstring's (=)): the fastest measured over the
  cache the plan holds."""
  if not hopper:
    return "triton"
  if kv_cache == "dense" or b.mosaic_gpu:
    return "fused"
  return "triton"


def resolve(config: Any, backend: Backend | None = None) -> KernelPlan:
  """The plan of `config` (a `ModelConfig`) on `backend` (default `Backend.current()`):
  forced fields as given, the rest from the config's preset or by the module docstring's
  rules."""
  b = Backend.current() if backend is None else backend
  preset = PRESETS[config.plan]

  def pick(name: str, auto: str) -> str:
    value = getattr(config, name)
    return value if value != AUTO else preset.get(name, auto)

  fwd = config.forward
  kernels = b.hopper
  decode = pick("decode_impl", "kernel" if kernels and fwd.fp4 in (None, "nvfp4")
                and _decode_kernel_shapes(config) else "xla")
  nvfp4 = fwd.fp4 == "nvfp4"
  kv = pick("kv_cache", "packed" if decode == "kernel" else "dense") if nvfp4 else "dense"
  sites = pick("nvfp4_sites", "kernel" if decode == "kernel" else "xla") if nvfp4 else "xla"
  return KernelPlan(
      moe_impl=pick("moe_impl", _moe_impl(b, config)),
      decode_impl=decode,
      decode_moe_kernel=pick("decode_moe_kernel", "wgmma" if kernels and b.mosaic_gpu
                             else "triton"),
      fp4_codes=pick("fp4_codes", default_codes(b)),
      decode_attention=pick("decode_attention", _decode_attention(kernels, b, kv)),
      kv_cache=kv, nvfp4_sites=sites,
      kv_write=(pick("kv_write", "kernel" if kernels else "xla")
                if kv == "packed" and sites == "kernel" else "xla"),
      fp8_gemm=pick("fp8_gemm", ("wgmma" if b.mosaic_gpu else "kernel") if kernels else "xla"),
      fp8_bwd_operands=pick("fp8_bwd_operands", "kernel" if kernels else "xla"),
      seq_attention=pick("seq_attention", "cudnn" if kernels and _cudnn_attention_shapes(config)
                         else "xla"),
      layer_loop=pick("layer_loop", "unrolled" if kernels
                      and config.num_hidden_layers <= UNROLLED_MAX_LAYERS else "scan"),
      fake_quant=pick("fake_quant", "kernel" if kernels else "xla") if nvfp4 else "xla",
      sm_count=b.sm_count, invariant=config.plan == INVARIANT)
