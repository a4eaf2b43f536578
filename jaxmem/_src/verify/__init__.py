"""Layer 6, verification: the compiled program's own memory figures."""
