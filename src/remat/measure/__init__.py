"""Torch side: exact bytes (allocator events, profiles) and time models."""
