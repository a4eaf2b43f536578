"""Layer 8, the public API: ``analyze``, ``plan``, ``fit``, ``max_batch``, ``compare``."""
