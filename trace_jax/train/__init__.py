"""Training-side pieces: scoring sequences, the GRPO step, checkpoints."""
