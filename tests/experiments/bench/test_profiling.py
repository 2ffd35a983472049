"""experiments.bench.profiling: a trace of a known program, summarized per kernel."""

from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import pytest

from experiments.bench import profiling


@pytest.mark.parametrize("name, want", [
    pytest.param("grouped_matmul_decode_fp4__1", "pallas", id="pallas_kernel"),
    pytest.param("grouped_dgrad__1", "pallas", id="pallas_training_gemm"),
    pytest.param("decode_attention_scores_nvfp4", "pallas", id="pallas_attention"),
    pytest.param("flash_decode_nvfp4", "pallas", id="pallas_flash_decode"),
    pytest.param("nvfp4_quantize_rows", "pallas", id="pallas_activation_site"),
    pytest.param("nvfp4_kv_append__1", "pallas", id="pallas_kv_append"),
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


def test_host_events_are_summed_on_the_host_planes_of_a_gpu_profile_only():
  """Host events are summed by name with their host time (runtime annotations and CUPTI's
  driver calls alike); Python frames, a device plane's kernels and any CPU-only profile (whose
  host events are its kernels) are not."""
  ev = lambda name, dur: NS(name=name, duration_ns=dur, start_ns=0, stats=())
  planes = [
      NS(name="/host:CUPTI", lines=[
          NS(name="thread 1", events=[ev("cuLaunchKernelEx", 4000), ev("cuGraphLaunch", 9000),
                                      ev("cuLaunchKernelEx", 2000)]),
          NS(name="thread 2", events=[ev("cuMemcpyDtoHAsync_v2", 500)])]),
      NS(name="/host:CPU", lines=[NS(name="xla", events=[ev("command_buffer.3", 7),
                                                         ev("$bench.py:12 call", 1)])]),
      NS(name="/device:GPU:0", lines=[NS(name="Stream #1", events=[ev("cuGraphLaunch", 8)])]),
  ]
  assert dict(profiling._host_events(planes)) == {
      "cuLaunchKernelEx": [2, 6000], "cuGraphLaunch": [1, 9000],
      "cuMemcpyDtoHAsync_v2": [1, 500], "command_buffer.3": [1, 7]}
  assert dict(profiling._host_events(planes[:2])) == {}


def test_timeline_orders_host_and_device_events_around_the_anchor():
  """Rows are relative to the chosen anchor, host and device merged in time order, short host
  events and Python frames dropped; the device's wait for the launch is marked."""
  ev = lambda name, start, dur: NS(name=name, start_ns=start, duration_ns=dur, stats=())
  planes = [
      NS(name="/host:CPU", lines=[NS(name="main", events=[
          ev("cuGraphLaunch (CudaGraph:1)", 10_000, 900_000),
          ev("cuGraphLaunch (CudaGraph:1)", 3_000_000, 800_000),
          ev("MemcpyD2H", 2_950_000, 20_000), ev("tiny", 3_100_000, 500),
          ev("$engine.py:1 generate", 3_000_000, 5_000_000)])]),
      NS(name="/device:GPU:0", lines=[
          NS(name="Stream #14(Compute)", events=[ev("last_kernel", 2_900_000, 30_000),
                                                 ev("first_kernel", 3_700_000, 10_000)]),
          NS(name="XLA Ops", events=[ev("aggregate", 3_700_000, 10_000)])]),
  ]
  rows = profiling._timeline_rows(planes, "cuGraphLaunch", 1, before_ms=0.2, span_ms=1.0,
                                  min_host_us=2.0)
  assert [(start, name) for start, _, _, name in rows] == [
      (-100.0, "last_kernel"), (-50.0, "MemcpyD2H"), (0.0, "cuGraphLaunch (CudaGraph:1)"),
      (700.0, "first_kernel")]
  assert "device idle 770.0 us" in profiling.format_timeline(rows).splitlines()[-1]
  with pytest.raises(ValueError, match="2 host events start with 'cuGraphLaunch'; no index 2"):
    profiling._timeline_rows(planes, "cuGraphLaunch", 2, 0.2, 1.0, 2.0)
