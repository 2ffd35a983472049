"""The rollout benchmark's outside reference (`experiments.bench.rollout --transformers`): HF
transformers `generate` (BF16, greedy) on the benchmark's params exported as an HF checkpoint,
with the benchmark's prompts, timed by the benchmark's own timer."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Timer = Callable[[Callable[[], float]], dict[str, Any]]


def run(params: Any, config: Any, batches: Sequence[int], first_tokens: dict[str, list],
        prompts: Callable[[int], list[list[int]]], new_tokens: int, timed: Timer
        ) -> dict[str, Any]:
  """tokens/s of `generate` per batch (`timed`: the benchmark's warm-up and median), and the
  share of first generated tokens equal to the engine's bf16 ones (`first_tokens`, keyed
  "bf16:<impl>:<batch>") where the benchmark ran that batch."""
  import torch
  import transformers

  from trace_jax.io import hf

  dev = os.environ.get("TRACE_TORCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
  res: dict[str, Any] = {"device": dev, "transformers": transformers.__version__,
                         "torch": torch.__version__, "cases": {}}
  transformers.utils.logging.disable_progress_bar()
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as d:
    hf.save_hf_checkpoint(d, config, params, dtype="bfloat16", progress=False)
    res["export_s"] = time.perf_counter() - t0
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(d)
    model = model.to(device=dev, dtype=torch.bfloat16).eval()
  res["load_s"] = time.perf_counter() - t0 - res["export_s"]
  res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
  res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
  for batch in batches:
    r = _time_generate(model, dev, prompts(batch), new_tokens, timed)
    ours = first_tokens.get(f"bf16:kernel:{batch}") or first_tokens.get(f"bf16:xla:{batch}")
    if ours:  # same checkpoint: greedy first tokens mostly agree (BF16 near-ties may not)
      r["first_token_agreement"] = float(np.mean(r.pop("_first") == np.asarray(ours)))
    r.pop("_first", None)
    res["cases"][str(batch)] = r
    print(f"  transformers:{batch:<9} {r['tokens_per_s']:>10,.0f} tok/s  warm-up call "
          f"{r['first_call_s']:6.1f} s  ({dev}, attention {res['attn_implementation']}, "
          f"experts {res['experts_implementation']})", flush=True)
  del model
  if dev.startswith("cuda"):
    torch.cuda.empty_cache()
  return res


def _time_generate(model: Any, dev: str, prompts: list[list[int]], n: int, timed: Timer
                   ) -> dict[str, Any]:
  """One batch of `model.generate`: timings, tokens (checked: exactly n new tokens per row)
  and the first generated tokens (`_first`)."""
  import torch

  sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
  ids = torch.tensor(prompts, device=dev)
  batch, p = ids.shape
  out: list[Any] = []

  def call() -> float:
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
      # Exactly n new tokens: greedy, and no EOS can end a row early (min_new_tokens).
      out[:] = [model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=0)]
    sync()
    return time.perf_counter() - t0

  r: dict[str, Any] = timed(call)
  del r["compile_s"]  # eager torch: the first call is a warm-up, not a compile
  got = tuple(out[0].shape)
  if got != (batch, p + n):
    raise RuntimeError(f"transformers generate returned {got}, expected {(batch, p + n)}")
  r.update(tokens=batch * n, tokens_per_s=batch * n / r["median_s"],
           _first=out[0][:, p].cpu().numpy())
  return r
