"""K/V rows quantized and written into the packed KV cache in one kernel (`kernels.kv_append`).

Every array of the cache, bit for bit, against the XLA path it replaces (`kv_append.reference`:
`kv_cache.quantize_rows`, the `formats` quantizer, then `kv_cache.write_quantized`'s
scatters), on random rows and the adversarial NVFP4 rows, both code layouts, into a cache
already holding other rows (which must survive); XLA's position rules (negative positions wrap,
positions past the end are dropped); the lowering to Triton IR for CUDA, traced as on the GPU.
The sites' guidance records (compact and full) against `guided.record`'s. The kernel runs as
the interpreter on CPU (`interpret=None`). Shapes stay tiny and shared (one interpreter compile
per shape, dtype and layout).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.nvfp4_rows import ADV_K, ADV_ROWS, ADVERSARIAL, DTYPES, adversarial_input
from trace_jax.kernels import kv_append, kv_cache

L, T = 2, 8  # layers and positions of the random cases' cache stack
_reference = jax.jit(kv_append.reference, static_argnames="tap")


def _bits(cache: kv_cache.PackedKVCache) -> dict[str, np.ndarray]:
  """Every array of the cache as unsigned integers of its width (NaN payloads compared too)."""
  view = {1: np.uint8, 4: np.uint32}
  return {name: np.asarray(jax.lax.bitcast_convert_type(a, view[a.dtype.itemsize])
                           if a.dtype.kind == "f" or a.dtype == jnp.float8_e4m3fn else a)
          for name, a in zip(("k_codes", "v_codes", "k_block", "v_block", "k_row", "v_row"),
                             jax.tree.leaves(cache))}


def _assert_caches_equal(got, want, what: str) -> None:
  for name, (a, b) in {n: (_bits(got)[n], _bits(want)[n]) for n in _bits(got)}.items():
    bad = np.argwhere(a != b)
    assert not len(bad), f"{what}: {name} differs at {len(bad)} entries, first {bad[:3].tolist()}"


def _filled_cache(b: int, g: int, h: int, words: bool, seed: int) -> kv_cache.PackedKVCache:
  """A stack [L, B, T, G, H] whose every slot holds random bits (so a write that lands in the
  wrong slot, or clobbers a neighbour, changes bits)."""
  empty = jax.tree.map(lambda a: jnp.stack([a] * L),
                       kv_cache.init_packed_cache(b, T, g, h, words=words))
  keys = jax.random.split(jax.random.key(seed), 6)
  fill = lambda a, key: jax.lax.bitcast_convert_type(
      jax.random.bits(key, a.shape, jnp.uint8 if a.dtype.itemsize == 1 else jnp.uint32),
      a.dtype)
  return jax.tree.unflatten(jax.tree.structure(empty),
                            [fill(a, key) for a, key in zip(jax.tree.leaves(empty), keys)])


def _assert_records_equal(got, want, what: str) -> None:
  for name in ("block_scale", "row_scale", "mantissa", "codes"):
    a, b = getattr(got, name), getattr(want, name)
    assert (a is None) == (b is None), f"{what}: record field {name}"
    if a is not None:
      a, b = (np.asarray(x).view(np.uint8 if x.dtype.itemsize == 1 else np.uint32)
              for x in (a, b))
      assert a.shape == b.shape, f"{what}: record {name} of shape {a.shape}, want {b.shape}"
      bad = np.argwhere(a != b)
      assert not len(bad), f"{what}: record {name} differs at {len(bad)} entries"


def _check(cache, k, v, positions, layer, what: str, tap: str | None = None
           ) -> kv_cache.PackedKVCache:
  """The kernel's cache (and record, with `tap`) against the XLA path's, bit for bit."""
  got = kv_append.append(cache, k, v, positions, layer, tap=tap)
  want = _reference(cache, k, v, positions, layer, tap=tap)
  if tap is None:
    got, want = (got, None), (want, None)
  _assert_caches_equal(got[0], want[0], what)
  if tap is not None:
    _assert_records_equal(got[1], want[1], f"{what}/{tap}")
  return got[0]


RANDOM = [  # (id, B, S, G, H, dtype, words, tap)
    ("bf16_words_g3_full", 2, 1, 3, 64, "bfloat16", True, "full"),
    ("f16_bytes_g3_s2_compact", 2, 2, 3, 64, "float16", False, "compact"),
]  # float32 rows and H = 128: the adversarial cases; no tap: the position and control cases


@pytest.mark.parametrize("name,b,s,g,h,dtype,words,tap", RANDOM, ids=[c[0] for c in RANDOM])
def test_random_rows_match_the_xla_write(name, b, s, g, h, dtype, words, tap):
  """Rows of mixed magnitudes at distinct positions of layer 1, then of layer -1 (the last):
  every cache array (and the record, where tapped) equal bit for bit, the other layer's and
  positions' rows kept."""
  cache = _filled_cache(b, g, h, words, seed=b + g)
  key = jax.random.key(h + s)
  scale = jnp.exp2(jax.random.randint(key, (1, b, s, g, 1), -20, 20).astype(jnp.float32))
  k, v = (jax.random.normal(jax.random.fold_in(key, 1), (2, b, s, g, h)) * scale)
  k, v = k.astype(DTYPES[dtype]), v.astype(DTYPES[dtype])
  positions = (jnp.arange(b * s, dtype=jnp.int32).reshape(b, s) * 3) % T
  got = _check(cache, k, v, positions, 1, name, tap)
  before = _bits(cache)
  assert (_bits(got)["k_row"][0] == before["k_row"][0]).all()  # layer 0 untouched
  assert (_bits(got)["k_row"][1] != before["k_row"][1]).any()  # layer 1 written
  _check(cache, k, v, positions, -1, f"{name}/layer -1", tap)


def test_positions_wrap_or_drop_as_xla_scatters():
  """Negative positions count from the end (p + T); positions past the end, or still negative,
  and a layer outside the stack write nothing: XLA's scatter rules, bit for bit."""
  b, g, h = 2, 3, 64
  cache = _filled_cache(b, g, h, True, seed=7)
  k, v = jax.random.normal(jax.random.key(3), (2, b, 1, g, h), jnp.bfloat16)
  positions = jnp.asarray([[-1], [T]], jnp.int32)
  got = _check(cache, k, v, positions, 0, "wrap and drop")
  assert (_bits(got)["v_row"][0, 1] == _bits(cache)["v_row"][0, 1]).all()  # position T dropped
  _check(cache, k, v, positions - T, 0, "wrap once and drop")  # -T - 1 stays negative
  _assert_caches_equal(kv_append.append(cache, k, v, positions, L), cache, "layer L")


@pytest.mark.parametrize("words,dtype,tap", [(False, "float32", "compact"),
                                             (True, "bfloat16", "full")],
                         ids=["bytes_f32_compact", "words_bf16_full"])
def test_adversarial_rows_match_the_xla_write(words, dtype, tap):
  """The adversarial NVFP4 rows (ties, saturation, signed zeros, subnormals, tiny and huge
  scales, NaN/Inf) as K, the same rows reversed as V: B = 5 sequences of one kv head, every
  case written over a filled cache, cache and record equal bit for bit."""
  cache = _filled_cache(ADV_ROWS, 1, ADV_K, words, seed=11)
  positions = jnp.asarray([[3], [0], [T - 1], [5], [3]], jnp.int32)
  for name, make, _ in ADVERSARIAL:
    x = adversarial_input(make, dtype).reshape(ADV_ROWS, 1, 1, ADV_K)
    _check(cache, x, x[::-1], positions, 1, f"{name}/{dtype}", tap)


def test_control_a_write_at_another_position_is_caught():
  """The comparison can fail: the kernel's cache against the XLA write one position later."""
  b, g, h = 2, 3, 64
  cache = _filled_cache(b, g, h, True, seed=5)
  k, v = jax.random.normal(jax.random.key(9), (2, b, 1, g, h), jnp.bfloat16)
  positions = jnp.asarray([[1], [4]], jnp.int32)
  got = kv_append.append(cache, k, v, positions, 0)
  with pytest.raises(AssertionError, match="differs at"):
    _assert_caches_equal(got, _reference(cache, k, v, positions + 1, 0), "control")


def test_bad_inputs_are_refused_in_one_line():
  cache = _filled_cache(2, 3, 64, True, seed=1)
  k = jnp.zeros((2, 1, 3, 64), jnp.bfloat16)
  pos = jnp.zeros((2, 1), jnp.int32)
  with pytest.raises(ValueError, match=r"a cache stack of K/V shape \[L, B, T, G, H\] expected"):
    kv_append.append(jax.tree.map(lambda a: a[0], cache), k, k, pos, 0)
  with pytest.raises(ValueError, match=r"must both be \[B, S, G, H\] with \(B, G, H\)"):
    kv_append.append(cache, k, jnp.zeros((2, 1, 2, 64), jnp.bfloat16), pos, 0)
  with pytest.raises(TypeError, match="k must be bf16, f16 or float32, got int32"):
    kv_append.append(cache, k.astype(jnp.int32), k, pos, 0)
  with pytest.raises(ValueError, match=r"positions of shape \(2,\), expected \(2, 1\)"):
    kv_append.append(cache, k, k, pos[:, 0], 0)
  with pytest.raises(ValueError, match=r"tap must be None or one of \('compact', 'full'\)"):
    kv_append.append(cache, k, k, pos, 0, tap="codes")


@pytest.fixture
def traced_as_on_gpu(monkeypatch):
  """Backend-dependent code traces its GPU branch (`exact`'s fully unrolled loops) while this
  host lowers for CUDA."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.mark.parametrize("words,g,tap", [(True, 4, None), (True, 4, "full"),
                                         (False, 3, "compact")],
                         ids=["words_g4", "words_g4_full", "bytes_g3_compact"])
def test_lowers_to_triton(words, g, tap, traced_as_on_gpu):
  """The kernel passes Pallas' Triton lowering for CUDA on any host, its cache outputs aliased
  to its cache inputs (written in place); Triton's own compilation needs the GPU run."""
  cache = jax.tree.map(lambda a: jnp.stack([a] * 3),
                       kv_cache.init_packed_cache(4, 16, g, 128, words=words))
  k = jnp.zeros((4, 1, g, 128), jnp.bfloat16)
  f = functools.partial(kv_append.append, interpret=False, tap=tap)
  text = jax.jit(f).trace(cache, k, k, jnp.zeros((4, 1), jnp.int32), jnp.int32(1)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "triton" in text and "nvfp4_kv_append" in text
  assert "output_operand_aliases" in text
