"""Rollouts for RL trainers: GRPO groups forked from one warm workspace (``_rollout``) and trajectory
records (``_trajectory``): what ``bunshin_async.rollout`` re-exports."""
