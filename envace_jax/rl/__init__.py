"""Rewards, role-wise advantages and the GRPO update."""
