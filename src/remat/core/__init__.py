"""The pure core: costs, plans, the simulator and the whole-step model (no torch)."""
