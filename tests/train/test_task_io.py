"""TaskIO with an HF tokenizer: BOS only when the tokenizer has one, its EOS ends completions,
and one GRPO step runs end to end on a model whose vocabulary is the tokenizer's."""

import numpy as np
import pytest

from configs import quickstart
from trace_jax import model as model_lib
from trace_jax.rl.tokenizer import CharTokenizer, HFTokenizer
from trace_jax.train import rl_loop, run_config, task_io


def cfg_with(tokenizer: str):
  c = quickstart.get_config()
  c.task.tokenizer = tokenizer
  c.task.kwargs.sloppy_demos = 0.0  # every demonstration correct
  return c


@pytest.mark.parametrize("bos", [False, True], ids=["no_bos", "bos"])
def test_prompts_and_demonstrations_use_the_tokenizer(bpe_tokenizer, bos):
  io = task_io.make_task_io(run_config.resolve(cfg_with(bpe_tokenizer(bos=bos))))
  assert isinstance(io.tok, HFTokenizer)
  problems, prompts = io.prompts(0, 4)
  for p, ids in zip(problems, prompts):
    body = io.tok.encode(p.prompt)
    assert ids == ([io.tok.bos_id] if bos else []) + body
    assert len(body) < len(p.prompt)  # BPE merges: not one id per character
  demos, masks = io.demonstrations(problems, prompts)
  assert masks is None
  for p, d in zip(problems, demos):
    assert d[-1] == io.eos_id == io.tok.eos_id != CharTokenizer.eos_id
    assert io.text(d) == io.task.demonstration(p)  # EOS dropped, text round-trips
    assert io.task.reward(p, io.text(d)) == 1.0
  assert io.sampling(max_new_tokens=3).stop_token_ids == (io.eos_id,)


def test_text_marks_ids_past_the_vocabulary(bpe_tokenizer):
  io = task_io.make_task_io(run_config.resolve(cfg_with(bpe_tokenizer())))
  ab = io.tok.encode("ab")
  assert io.text(ab + [io.tok.vocab_size + 3] + ab + [io.eos_id]) == "ab?ab"
  assert io.text([io.tok.vocab_size]) == "?"
  char = task_io.make_task_io(run_config.resolve(quickstart.get_config()))
  assert isinstance(char.tok, CharTokenizer) and char.bos_ids == [CharTokenizer.bos_id]


def test_validate_names_the_tokenizer(bpe_tokenizer, tmp_path):
  cfg = cfg_with(bpe_tokenizer())  # 400 ids > the quickstart model's 100
  with pytest.raises(ValueError, match=r"vocab_size=100 is smaller than the tokenizer's \d+ "
                                       r"\(task.tokenizer="):
    rl_loop.validate(cfg)
  cfg.task.tokenizer = str(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="no HF tokenizer"):
    rl_loop.validate(cfg)


def test_rl_step_with_an_hf_tokenizer(bpe_tokenizer, tmp_path):
  cfg = cfg_with(bpe_tokenizer())
  cfg.model.vocab_size = 512
  cfg.model.num_hidden_layers = 1
  cfg.sft.steps = 1
  cfg.rl.update(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=8, seeds=(0,))
  cfg.eval.update(num_prompts=4, every=100, posthoc_fp4=False)
  cfg.max_prompt_len, cfg.seq_len = 64, 80
  rl_loop.validate(cfg)
  params = model_lib.init_params(rl_loop.model_config(cfg), 0, param_dtype="float32")
  out = rl_loop.run_rl(cfg, str(tmp_path), "fp4_trace", params, progress=False)
  row = out["history"][0]
  assert np.isfinite(row["loss"]) and row["grad_norm"] > 0 and 0 <= row["reward"] <= 1
  assert row["guidance_bytes_per_token"] > 0
