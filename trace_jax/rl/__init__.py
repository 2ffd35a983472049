"""RL (docs/design.md §8): tasks, tokenizer, GRPO advantages and losses."""

from trace_jax.rl.advantages import (
    ADVANTAGE_FNS,
    get_advantage_fn,
    group_advantages,
    group_stats,
)
from trace_jax.rl.losses import (
    IS_MODES,
    importance_weights,
    k3_kl,
    masked_mean,
    mismatch_metrics,
    ppo_clip_loss,
)
from trace_jax.rl.tasks import TASKS, Problem, Task, get_task
from trace_jax.rl.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    CharTokenizer,
    HFTokenizer,
    OutOfVocabularyError,
    concat_prompt_completion,
    encode_ids,
    make_tokenizer,
    pad_batch,
)

__all__ = [
    "ADVANTAGE_FNS", "BOS_ID", "EOS_ID", "IS_MODES", "PAD_ID", "TASKS", "CharTokenizer",
    "HFTokenizer",
    "OutOfVocabularyError", "Problem", "Task", "concat_prompt_completion", "encode_ids",
    "get_advantage_fn", "get_task", "group_advantages", "group_stats", "importance_weights",
    "k3_kl", "make_tokenizer", "masked_mean", "mismatch_metrics", "ppo_clip_loss",
    "pad_batch",
]
