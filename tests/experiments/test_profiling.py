"""experiments.profiling: a trace of a known program, summarized per kernel."""

from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import pytest

from experiments import profiling


@pytest.mark.parametrize("name, want", [
    pytest.param("grouped_matmul_decode_fp4__1", "pallas", id="pallas_kernel"),
    pytest.param("grouped_dgrad__1", "pallas", id="pallas_training_gemm"),
    pytest.param("decode_attention_scores_nvfp4", "pallas", id="pallas_attention"),
    pytest.param("nvjet_sm90_tst_256x64_64x5_1x2_h_bz_TNT", "gemm", id="cublas_nvjet"),
    pytest.param("gemm_fusion_dot_21", "gemm", id="xla_gemm_fusion"),
    pytest.param("memcpy32_post", "memcpy", id="memcpy"),
    pytest.param("loop_dynamic_update_slice_fusion_8", "copy/update", id="update_slice"),
    pytest.param("sort_30_1", "sort/top-k", id="sort"),
    pytest.param("loop_multiply_fusion", "fusion/other", id="elementwise"),
])
def test_categories(name, want):
  assert profiling.category(name) == want


def test_a_sort_heavy_program_is_attributed_to_its_sort(tmp_path):
  f = jax.jit(lambda x: jnp.sort(x * 2.0, axis=-1))
  x = jax.random.normal(jax.random.key(0), (256, 4096))
  f(x).block_until_ready()
  with profiling.trace(str(tmp_path)):
    for _ in range(2):
      f(x).block_until_ready()
  one = profiling.summarize(str(tmp_path), steps=1)
  two = profiling.summarize(str(tmp_path), steps=2)
  assert one["top"][0][1] == "sort/top-k", one["top"]
  assert one["categories"]["sort/top-k"] > 0.5 * one["busy_ms"]
  assert 0 < one["busy_ms"] <= one["wall_ms"] + 1e-9
  assert two["busy_ms"] == pytest.approx(one["busy_ms"] / 2)
  assert two["kernels"] == pytest.approx(one["kernels"] / 2)
  assert "sort" in profiling.format_summary(one, "t")


def test_missing_traces_are_reported(tmp_path):
  with pytest.raises(FileNotFoundError, match="no .xplane.pb"):
    profiling.summarize(str(tmp_path))
  with pytest.raises(ValueError, match="steps"):
    profiling.summarize(str(tmp_path), steps=0)


def test_idle_gaps_are_charged_to_the_kernel_that_ended_them():
  # a 0-10, b 30-40 (20 ns idle before it), c 35-50 overlaps b, a 52-60 (2 ns: under the bar),
  # b 100-110 (40 ns idle).
  events = [("a", "a", 0, 10), ("b", "b", 30, 10), ("c", "c", 35, 15), ("a", "a", 52, 8),
            ("b", "b", 100, 10)]
  gaps = profiling._gaps(events, min_ns=5)
  assert dict(gaps) == {"b": [60.0, 2]}
  assert dict(profiling._gaps(events, min_ns=1)) == {"b": [60.0, 2], "a": [2.0, 1]}


def test_host_cuda_calls_are_counted_on_host_planes_only():
  """Driver calls on the host planes are counted with their host time; XLA's thunk events
  (other names) and a device plane's kernels (even one named like a driver call) are not."""
  ev = lambda name, dur: NS(name=name, duration_ns=dur, start_ns=0, stats=())
  planes = [
      NS(name="/host:CUPTI", lines=[
          NS(name="thread 1", events=[ev("cuLaunchKernelEx", 4000), ev("cuGraphLaunch", 9000),
                                      ev("cuLaunchKernelEx", 2000), ev("cudaLaunchKernel", 1)]),
          NS(name="thread 2", events=[ev("cuMemcpyDtoHAsync_v2", 500)])]),
      NS(name="/host:CPU", lines=[NS(name="xla", events=[ev("fusion.3", 7), ev("$bookkeeping",
                                                                                 1)])]),
      NS(name="/device:GPU:0", lines=[NS(name="Stream #1", events=[ev("cuLaunchKernelEx", 8)])]),
  ]
  assert dict(profiling._host_calls(planes)) == {
      "cuLaunchKernelEx": [2, 6000], "cuGraphLaunch": [1, 9000], "cudaLaunchKernel": [1, 1],
      "cuMemcpyDtoHAsync_v2": [1, 500]}
  assert dict(profiling._host_calls(planes[1:2])) == {}
