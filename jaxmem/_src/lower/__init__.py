"""Layer 5, lowering: rewrite backends that turn a planned schedule into a program XLA compiles."""
