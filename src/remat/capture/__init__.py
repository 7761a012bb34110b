"""Torch side: turning a model and a batch into a costed chain or graph."""
