"""experiments/bench/decode_attention.py: the on-device bit check of the packed cache's decoders,
the paths of its flags, and one case's record (checked, timed, related)."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench import decode_attention as bda
from trace_jax.kernels import decode_attention as da


def test_every_byte_cache_covers_every_code_under_every_scale():
  cache = bda.every_byte_cache(32)
  codes = np.asarray(cache.k_codes).reshape(-1, 8)  # 8 code bytes per block
  scales = np.asarray(cache.k_block).view(np.uint8).reshape(-1)
  pairs = {(int(s), int(c)) for s, block in zip(scales, codes) for c in block}
  assert len(pairs) == 256 * 256
  rows = np.asarray(cache.k_row).reshape(-1)
  assert np.any(rows >= 2.0**118) and np.any(rows == 1.0)


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
def test_decoder_check_passes_and_can_fail(monkeypatch, words):
  """Equal bits on the real decoders (the cache's layout picks the words or the bits one); a
  decoder off by one ulp in one element is reported."""
  res = bda.decoder_check(32, [16], words)
  assert set(res) == {("words" if words else "bytes") + "_default_bt16", "bytes_bits_bt16"}
  assert all(v["bits_equal"] for v in res.values()), res
  real = da.dequantize_pallas

  def off_by_one(*a, **k):
    k_, v_ = real(*a, **k)
    bits = np.asarray(k_).view(np.uint16).copy()
    bits[0, 1, 0, 3] ^= 1
    return jnp.asarray(bits.view(jnp.bfloat16)), v_

  monkeypatch.setattr(da, "dequantize_pallas", off_by_one)
  res = bda.decoder_check(32, [16], words)
  assert all(not v["bits_equal"] and v["mismatches"] == 1 for v in res.values()), res


def test_prefetch_variants_run_the_wgmma_kernels_with_their_distance():
  """`--prefetch=0,2,5` keeps the wgmma paths at distance 0 and adds one path per other
  distance beside each, with its own AttentionConfig; a variant's name maps back to its path."""
  paths = bda._paths(32, 64, 0, 4, 2, prefetch=(0, 2, 5))
  for base in bda.GPU_ONLY:
    assert paths[base].keywords["config"].prefetch == 0
    for d in (2, 5):
      config = paths[f"{base}_prefetch{d}"].keywords["config"]
      assert (config.impl, config.prefetch) == (base[len("kernel_packed_"):], d)
      assert bda.base_impl(f"{base}_prefetch{d}") == base
  assert not any("prefetch" in k for k in bda._paths(32, 64, 0, 4, 2))
  assert bda.base_impl("kernel_packed") == "kernel_packed"


def test_pv_split_variants_run_the_wgmma_pair_with_their_splits():
  """`--pv_splits=1,4` adds `kernel_packed_wgmma_splits<s>` beside the wgmma pair, its own
  AttentionConfig with those splits, the name mapping back to the pair; none without it."""
  paths = bda._paths(32, 64, 0, 4, 2, prefetch=(1,), pv_splits=(1, 4))
  assert paths["kernel_packed_wgmma"].keywords["config"].num_splits is None
  for sp in (1, 4):
    config = paths[f"kernel_packed_wgmma_splits{sp}"].keywords["config"]
    assert (config.impl, config.num_splits, config.prefetch) == ("wgmma", sp, 1)
    assert bda.base_impl(f"kernel_packed_wgmma_splits{sp}") == "kernel_packed_wgmma"
  assert not any("splits" in k for k in bda._paths(32, 64, 0, 4, 2))


def test_wgmma_single_pass_takes_its_tile_whatever_block_t():
  """The wgmma single pass runs 64-key tiles only: `--block_t` sets the Triton kernels'
  blocks, not its."""
  paths = bda._paths(32, 128, 0, 4, 2)
  assert paths["kernel_packed_wgmma_fused"].keywords["config"].block_t == 64
  assert paths["kernel_packed_fused"].keywords["config"].block_t == 128


def test_a_case_checks_times_and_relates_its_paths(capsys):
  """A small case on CPU: the XLA reference and the Triton kernel (interpreted) pass their check
  and are timed beside the copy; the wgmma pair, which runs on a Hopper GPU only, records its
  error, and a ratio over it stays empty while the two timed paths' ratio is their times'."""
  kernel_args = dict(block_t=64, num_splits=0, num_warps=4, num_stages=2, prefetch=(),
                     pv_splits=())
  case = bda.run_case(2, 128, 1, 8, 128, ["xla_bf16", "kernel_bf16", "kernel_packed_wgmma"],
                      reps=2, warmup=1, inner=1, check_seqs=2, seed=0, kernel_args=kernel_args)
  impls = case["impls"]
  for name in ("xla_bf16", "kernel_bf16"):
    assert impls[name]["check_ok"] and impls[name]["median_ms"] > 0, impls[name]
    assert impls[name]["frac_copy"] == impls[name]["gbps"] / case["copy_gbps"]
  assert impls[bda.COPY]["frac_copy"] == 1.0
  assert "error" in impls["kernel_packed_wgmma"] and "median_ms" not in impls["kernel_packed_wgmma"]
  ratios = case["ratios"]
  assert ratios["time_kernel_bf16_over_xla_bf16"] == (impls["kernel_bf16"]["median_ms"]
                                                      / impls["xla_bf16"]["median_ms"])
  assert ratios["time_kernel_packed_wgmma_over_kernel_bf16"] is None
  assert set(ratios) == {"kv_bytes_packed_over_bf16"} | {
      f"time_{a}_over_{b}" for a, b in bda.TIME_RATIOS}
  assert "B=2    T=128    kernel_bf16" in capsys.readouterr().out
