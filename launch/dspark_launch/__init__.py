"""Two-node launcher for vLLM with DSpark: profiles, site files, preflight, start, stop."""
