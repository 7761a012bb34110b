"""Torch side: executors that carry out a plan (they never make one)."""
