"""Layer 2, the estimate: XLA's model applied to a program, lifetimes, costs, device profiles."""
