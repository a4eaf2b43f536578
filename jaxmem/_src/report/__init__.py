"""Layer 7, reports: text, JSON, PNG and HTML views of a program and its plan."""
