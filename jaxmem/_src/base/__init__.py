"""Layer 0: what every layer may use -- errors, budget parsing, progress lines."""
