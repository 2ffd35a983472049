"""Rollout/trainer mismatch counts: FP4 code flips, block-scale flips and routing flips.

Numpy functions of host arrays, so the RL loop, `experiments/measure_mismatch.py` and the
notebooks count the same way; the RL loop counts its own audit with `compare_step_device`,
the same counts made on the device where the trainer's taps are (tests hold it to the numpy
ones). Inputs are full-mode records (`Guidance` with 4-bit `codes`) of
the same token rows, one from the rollout and one from the training forward.

- A code flip is an element whose E2M1 *value* differs (+0 and -0 are equal); `one_apart`
  counts the flips to an adjacent grid point (the drift guided rounding can undo).
- A scale flip is an E4M3 block scale whose bits differ (under guided rounding the trainer
  uses the rollout's scales, so it has none by construction).
- `expert_mid` rows are (token, top-k slot), each side in its own slot order; they are compared
  by expert id (trainer slot j against the rollout slot holding the same expert). A trainer
  slot whose expert the rollout did not select has nothing to compare with: it is counted in
  `RoutingCount.unmatched_slots` (under `fp4_trace` such a slot is quantized RTN).
- Routing: a token flips when its *set* of experts differs; an order swap is the same set in
  another order (invisible to a sorted comparison, harmful to slot-matched guidance).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.guidance import layout as guidance_layout
from trace_jax.guidance.layout import unpad
from trace_jax.model.config import SITES


def unpack_codes(packed: Any) -> np.ndarray:
  """4-bit codes from bytes packed two per byte (element 2i in the low nibble)."""
  p = np.asarray(packed, np.uint8)
  return np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[:-1] + (p.shape[-1] * 2,))


def e2m1_ordinal(codes: Any) -> np.ndarray:
  """Signed position of each E2M1 code on the grid, -7..7; +0 and -0 are both 0.

  Adjacent grid values differ by one, so |ordinal(a) - ordinal(b)| counts the grid steps
  between two codes (the magnitude code already orders the magnitudes).
  """
  c = np.asarray(codes, np.uint8)
  mag = (c & 7).astype(np.int8)
  return np.where(c & 8, -mag, mag).astype(np.int8)


@dataclasses.dataclass
class FlipCount:
  """Code and block-scale flips at one (layer, site), or summed over several."""
  flips: int = 0
  total: int = 0
  one_apart: int = 0
  scale_flips: int = 0
  scale_total: int = 0

  def __add__(self, other: FlipCount) -> FlipCount:
    return FlipCount(*(a + b for a, b in zip(dataclasses.astuple(self),
                                             dataclasses.astuple(other))))

  @property
  def rate(self) -> float | None:
    return self.flips / self.total if self.total else None

  @property
  def one_apart_share(self) -> float | None:
    return self.one_apart / self.flips if self.flips else None

  @property
  def scale_rate(self) -> float | None:
    return self.scale_flips / self.scale_total if self.scale_total else None


@dataclasses.dataclass
class RoutingCount:
  """Routing differences at one layer (or summed): tokens and (token, slot) pairs."""
  tokens: int = 0
  set_flips: int = 0
  order_swaps: int = 0
  slots: int = 0
  unmatched_slots: int = 0

  def __add__(self, other: RoutingCount) -> RoutingCount:
    return RoutingCount(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                dataclasses.astuple(other))))

  @property
  def flip_rate(self) -> float | None:
    return self.set_flips / self.tokens if self.tokens else None

  @property
  def order_swap_rate(self) -> float | None:
    return self.order_swaps / self.tokens if self.tokens else None

  @property
  def unmatched_rate(self) -> float | None:
    return self.unmatched_slots / self.slots if self.slots else None


def match_slots(train_ids: Any, rollout_ids: Any) -> tuple[np.ndarray, np.ndarray]:
  """For each trainer slot [..., K], the rollout slot routed to the same expert.

  Returns (src, matched): src[..., j] is that rollout slot (0 where none) and matched[..., j]
  whether there is one. Expert ids within a token are distinct (top-k).
  """
  t, r = np.asarray(train_ids), np.asarray(rollout_ids)
  if t.shape != r.shape:
    raise ValueError(f"routing shapes differ: trainer {t.shape}, rollout {r.shape}")
  eq = t[..., :, None] == r[..., None, :]
  return np.argmax(eq, axis=-1), np.any(eq, axis=-1)


def routing_counts(train_ids: Any, rollout_ids: Any) -> RoutingCount:
  """Set flips, order swaps and unmatched slots between routing ids [T, K]."""
  t, r = np.asarray(train_ids), np.asarray(rollout_ids)
  _, matched = match_slots(t, r)
  same_set = np.all(np.sort(t, -1) == np.sort(r, -1), axis=-1)
  same_order = np.all(t == r, axis=-1)
  return RoutingCount(tokens=int(same_set.size), set_flips=int(np.sum(~same_set)),
                      order_swaps=int(np.sum(same_set & ~same_order)),
                      slots=int(matched.size), unmatched_slots=int(np.sum(~matched)))


def _packed(g: Any) -> np.ndarray:
  if getattr(g, "codes", None) is None:
    raise ValueError("flip counts need full-mode records (4-bit codes); got a compact record")
  return np.asarray(g.codes, np.uint8)


def _pair_table() -> np.ndarray:
  """For every pair of packed bytes (a << 8 | b): the flips between their two codes each
  (0-2) plus 4 x those one grid step apart (0-2), so one lookup per byte pair counts both."""
  ords = e2m1_ordinal(np.arange(16, dtype=np.uint8)).astype(np.int16)
  byte = np.arange(256)
  lo, hi = ords[byte & 0xF], ords[byte >> 4]
  d_lo = np.abs(lo[:, None] - lo[None, :])
  d_hi = np.abs(hi[:, None] - hi[None, :])
  flips = (d_lo != 0).astype(np.uint8) + (d_hi != 0)
  one = (d_lo == 1).astype(np.uint8) + (d_hi == 1)
  return (flips + 4 * one).reshape(-1)


_PAIRS = _pair_table()


def code_flips(train: Any, rollout: Any, slot_src: Any = None,
               slot_matched: Any = None) -> FlipCount:
  """Flips between two full records of the same rows.

  train, rollout: `Guidance` (full mode) with rows [T, ...]. For expert_mid (rows [T, K, ...]
  in each side's slot order) pass `match_slots(train_ids, rollout_ids)`: the rollout's rows are
  taken in the trainer's slot order and unmatched slots are left out.
  """
  tc, rc = _packed(train), _packed(rollout)  # two codes per byte, compared by table
  tb = np.asarray(train.block_scale).view(np.uint8)
  rb = np.asarray(rollout.block_scale).view(np.uint8)
  if tc.shape != rc.shape or tb.shape != rb.shape:
    raise ValueError(f"record shapes differ: trainer codes {tc.shape}, rollout {rc.shape}")
  if slot_src is not None:
    src = np.asarray(slot_src)
    if src.shape != tc.shape[:src.ndim] or src.ndim != 2:
      raise ValueError(f"slot_src {src.shape} must be the records' [T, K] leading shape")
    keep = np.asarray(slot_matched, bool).reshape(-1)
    t, k = src.shape  # rows (token, slot) flat: the rollout's taken in the trainer's order
    rows = (np.arange(t)[:, None] * k + src).reshape(-1)[keep]
    rc, rb = rc.reshape(t * k, -1)[rows], rb.reshape(t * k, -1)[rows]
    tc, tb = tc.reshape(t * k, -1)[keep], tb.reshape(t * k, -1)[keep]
  pairs = _PAIRS[(tc.astype(np.uint16) << 8) | rc]
  hist = np.bincount(pairs.reshape(-1), minlength=16)
  value = np.arange(hist.size)
  return FlipCount(flips=int(hist @ (value & 3)), total=2 * tc.size,
                   one_apart=int(hist @ (value >> 2)), scale_flips=int(np.count_nonzero(tb != rb)),
                   scale_total=int(tb.size))


@dataclasses.dataclass
class MismatchReport:
  """Counts per (layer, site) and per layer, with the guided layers named."""
  flips: dict[tuple[int, str], FlipCount]
  routing: dict[int, RoutingCount]
  guided_layers: tuple[int, ...]

  def total(self, guided: bool | None = None) -> FlipCount:
    """Flips summed over the guided layers (True), the others (False) or all (None)."""
    out = FlipCount()
    for (layer, _), c in self.flips.items():
      if guided is None or (layer in self.guided_layers) == guided:
        out = out + c
    return out

  def routing_total(self, layers: Iterable[int] | None = None) -> RoutingCount:
    out = RoutingCount()
    for layer, c in self.routing.items():
      if layers is None or layer in layers:
        out = out + c
    return out

  def metrics(self) -> dict[str, float | None]:
    """The run-log columns (see `METRICS`)."""
    g, u = self.total(True), self.total(False)
    r, rg = self.routing_total(), self.routing_total(self.guided_layers)
    return {"flip_rate_guided": g.rate, "flip_rate_unguided": u.rate,
            "flip_one_apart_share": self.total().one_apart_share,
            "scale_flip_rate_guided": g.scale_rate, "routing_flip_rate": r.flip_rate,
            "routing_order_swap_rate": r.order_swap_rate,
            "expert_unmatched_rate": rg.unmatched_rate}

  def rows(self) -> list[dict[str, Any]]:
    """One row per (layer, site) and per layer's routing, for a per-layer CSV."""
    out = []
    for (layer, site), c in sorted(self.flips.items()):
      out.append({"layer": layer, "site": site, "guided": int(layer in self.guided_layers),
                  "flips": c.flips, "total": c.total, "one_apart": c.one_apart,
                  "scale_flips": c.scale_flips, "scale_total": c.scale_total})
    for layer, c in sorted(self.routing.items()):
      out.append({"layer": layer, "site": "routing", "guided": int(layer in self.guided_layers),
                  "flips": c.set_flips, "total": c.tokens, "one_apart": c.order_swaps,
                  "scale_flips": c.unmatched_slots, "scale_total": c.slots})
    return out


METRICS = ("flip_rate_guided", "flip_rate_unguided", "flip_one_apart_share",
           "scale_flip_rate_guided", "routing_flip_rate", "routing_order_swap_rate",
           "expert_unmatched_rate")


def compare(train_taps: Mapping[int, Mapping[str, Any]],
            rollout_records: Mapping[int, Mapping[str, Any]],
            train_routing: Mapping[int, Any], rollout_routing: Mapping[int, Any],
            guided_layers: Iterable[int]) -> MismatchReport:
  """Counts for every (layer, site) both sides recorded, and for every layer's routing.

  train_taps / rollout_records: {layer: {site: full-mode Guidance}} of the same ragged rows;
  train_routing / rollout_routing: {layer: ids [T, K]} of the same rows (they align the
  expert_mid rows). Routing may cover more rows than the code records (audited sequences
  first): the code records' rows are the first rows of the routing.
  """
  flips: dict[tuple[int, str], FlipCount] = {}
  routing: dict[int, RoutingCount] = {}
  for layer in sorted(set(train_routing) & set(rollout_routing)):
    routing[layer] = routing_counts(train_routing[layer], rollout_routing[layer])
  for layer in sorted(set(train_taps) & set(rollout_records)):
    for site in SITES:
      if site not in train_taps[layer] or site not in rollout_records[layer]:
        continue
      t, r = train_taps[layer][site], rollout_records[layer][site]
      src = matched = None
      if site == "expert_mid":
        if layer not in train_routing or layer not in rollout_routing:
          raise ValueError(f"layer {layer}: expert_mid rows need both sides' routing")
        n = np.asarray(t.block_scale).shape[0]
        src, matched = match_slots(np.asarray(train_routing[layer])[:n],
                                   np.asarray(rollout_routing[layer])[:n])
      flips[(layer, site)] = code_flips(t, r, src, matched)
  return MismatchReport(flips, routing, tuple(sorted(set(guided_layers))))


def compare_step(train_taps: Mapping[int, Mapping[str, Any]], counts: list[int], n_audit: int,
                 rollout_records: Mapping[int, Mapping[str, Any]],
                 rollout_routing: Mapping[int, Any], guided_layers: Iterable[int]
                 ) -> MismatchReport:
  """`compare` for one training step: the trainer's taps come padded [B, S, ...] (sites for
  the first n_audit sequences, routing for all), the rollout's records as ragged rows
  (`counts[i]` rows for sequence i; full codes of the first n_audit sequences)."""
  train_routing = {layer: unpad(t["routing"], counts)
                   for layer, t in train_taps.items() if "routing" in t}
  train_sites = {} if not n_audit else {
      layer: {site: unpad(g, counts[:n_audit]) for site, g in t.items() if site != "routing"}
      for layer, t in train_taps.items()}
  return compare(train_sites, rollout_records if n_audit else {}, train_routing,
                 rollout_routing, guided_layers)


def guidance_bytes_per_token(guidance: Mapping[int, Mapping[str, Any]] | None,
                             routing: Mapping[int, Any] | None, tokens: int) -> float:
  """What a guided trainer consumes per token: its guidance records plus the expert ids that
  place them (and replay, under R3); 0 without guidance."""
  if not guidance:
    return 0.0
  n = (sum(g.nbytes for sites in guidance.values() for g in sites.values()) +
       sum(np.asarray(a).nbytes for a in (routing or {}).values()))
  return n / max(tokens, 1)


# ------------------------------------------------------------------------- on the device


def compare_step_device(train_taps: Mapping[int, Mapping[str, Any]], counts: list[int],
                        n_audit: int, rollout_records: Mapping[int, Mapping[str, Any]],
                        rollout_routing: Mapping[int, Any], guided_layers: Iterable[int]
                        ) -> MismatchReport:
  """`compare_step`'s counts made where the trainer's taps are: the rollout's ragged records
  are padded to the taps' [B, S, ...] layout and sent there, one program counts every site
  and layer, and only per-sequence counts come back (on a GPU the taps' copy to the host and
  the host's passes over them were most of an FP4 RL step's audit)."""
  train_routing = {layer: t["routing"] for layer, t in train_taps.items() if "routing" in t}
  layers = sorted(set(train_routing) & set(rollout_routing))
  if not layers:
    return MismatchReport({}, {}, tuple(sorted(set(guided_layers))))
  seq_len = int(np.shape(train_routing[layers[0]])[1])
  sites = {}
  if n_audit:
    audit_counts = list(counts[:n_audit])
    sites = {layer: {site: (train_taps[layer][site],
                            guidance_layout.pad_guidance(rollout_records[layer][site],
                                                         audit_counts, seq_len))
                     for site in SITES if site in train_taps[layer]
                     and site in rollout_records.get(layer, {})}
             for layer in sorted(set(train_taps) & set(rollout_records))}
  routing = {layer: (train_routing[layer][:len(counts)],
                     guidance_layout.pad_routing(rollout_routing[layer], counts, seq_len))
             for layer in layers}
  valid = np.arange(seq_len)[None, :] < np.asarray(counts)[:, None]
  got = jax.device_get(_device_counts(sites, routing, valid, max(n_audit, 0)))
  total = lambda a: int(np.sum(np.asarray(a, np.int64)))
  flips = {(layer, site): FlipCount(*(total(a) for a in c))
           for layer, per_site in got["sites"].items() for site, c in per_site.items()}
  routes = {layer: RoutingCount(*(total(a) for a in c)) for layer, c in got["routing"].items()}
  return MismatchReport(flips, routes, tuple(sorted(set(guided_layers))))


def _ordinal(c: jax.Array) -> jax.Array:
  """`e2m1_ordinal` of 4-bit codes held in a uint8 array."""
  mag = (c & 7).astype(jnp.int8)
  return jnp.where((c & 8) != 0, -mag, mag)


def _per_seq(a: jax.Array) -> jax.Array:
  """int32 sums over every axis but the first (sequences): exact, whatever the batch."""
  return jnp.sum(a.astype(jnp.int32), axis=tuple(range(1, a.ndim)))


def _site_counts(t: Any, r: Any, mask: jax.Array) -> tuple[jax.Array, ...]:
  """Per-sequence (flips, total, one_apart, scale_flips, scale_total) of two full records of
  the same padded rows; mask [rows...]: which (token[, slot]) rows count."""
  tc, rc = t.codes, r.codes
  d = [jnp.abs(_ordinal(tc & 15) - _ordinal(rc & 15)),
       jnp.abs(_ordinal(tc >> 4) - _ordinal(rc >> 4))]
  m = mask.reshape(mask.shape + (1,) * (tc.ndim - mask.ndim))  # over the record's last axes
  tb = jax.lax.bitcast_convert_type(t.block_scale, jnp.uint8)
  rb = jax.lax.bitcast_convert_type(r.block_scale, jnp.uint8)
  return (_per_seq(((d[0] != 0).astype(jnp.int32) + (d[1] != 0)) * m),
          _per_seq(jnp.broadcast_to(m, tc.shape)) * 2,
          _per_seq(((d[0] == 1).astype(jnp.int32) + (d[1] == 1)) * m),
          _per_seq((tb != rb) & m), _per_seq(jnp.broadcast_to(m, tb.shape)))


@functools.partial(jax.jit, static_argnums=3)
def _device_counts(sites: Any, routing: Any, valid: jax.Array, n_audit: int) -> dict:
  """The counts of `compare_step_device`, per sequence: {"sites": {layer: {site: 5 arrays}},
  "routing": {layer: 5 arrays}} (`FlipCount`'s and `RoutingCount`'s fields)."""
  out = {"sites": {}, "routing": {}}
  for layer, (t, r) in routing.items():
    eq = t[..., :, None] == r[..., None, :]
    matched = jnp.any(eq, axis=-1)
    same_set = jnp.all(jnp.sort(t, axis=-1) == jnp.sort(r, axis=-1), axis=-1)
    same_order = jnp.all(t == r, axis=-1)
    out["routing"][layer] = (_per_seq(valid), _per_seq(valid & ~same_set),
                             _per_seq(valid & same_set & ~same_order),
                             _per_seq(jnp.broadcast_to(valid[..., None], matched.shape)),
                             _per_seq(valid[..., None] & ~matched))
  audit = valid[:n_audit]
  for layer, per_site in sites.items():
    out["sites"][layer] = {}
    for site, (t, r) in per_site.items():
      mask = audit
      if site == "expert_mid":  # the rollout's slots taken in the trainer's order, by expert
        ids_t, ids_r = routing[layer][0][:n_audit], routing[layer][1][:n_audit]
        eq = ids_t[..., :, None] == ids_r[..., None, :]
        src = jnp.argmax(eq, axis=-1)[..., None]
        r = jax.tree.map(functools.partial(jnp.take_along_axis, indices=src, axis=2), r)
        mask = audit[..., None] & jnp.any(eq, axis=-1)
      out["sites"][layer][site] = _site_counts(t, r, mask)
  return out
