"""Layer 9, the command line: ``python -m jaxmem demo | report | max-batch | dsa``."""
