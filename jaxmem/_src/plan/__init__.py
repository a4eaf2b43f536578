"""Layer 3, the plan: decisions, the schedule they make, and its simulation (the one time model)."""
