"""The guidance format (docs/design.md §5) and its TensorStore store, in one package.

Format, importable without JAX (the SGLang plugin's torch recorder uses them):
  `record`     the record of a site (fields, dtypes, widths, bytes per row; `Guidance`), the
               sites and routing
  `schema`     the store's on-disk schema: batch ids, array paths, manifest, checksums, config
               hash, schema version
  `handle`     `GuidanceHandle`: where a sequence's records are
With JAX:
  `byte_rows`  a tree of per-row records as one uint8 row per row (the decode loop's records)
  `layout`     ragged rows (engine, store) <-> padded [B, S, ...] rows (trainer)
  `store`      `GuidanceStore` and its writer and reader (TensorStore zarr3)

The package imports no other part of trace_jax, so every layer may import it (quant's guided
rounding takes `record.Guidance`). Submodules are imported on use: this file imports none.
"""
