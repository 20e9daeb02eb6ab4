"""Base builders: the warmed-up tiny checkpoints the quickstart recipes and tests start from
(rollout/bases/warmup.py for the M3.1-architecture model, rollout/bases/hf_toy.py for a tiny Qwen3).
They sit in rollout/ because they measure their starting accuracy with the native engine, and the
DSpark drafter builder (rollout/dspark/train.py) trains against them.
"""
