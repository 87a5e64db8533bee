"""DSpark speculative decoding: draft state kept per request, not per batch row."""
