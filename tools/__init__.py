"""Command-line tools of this checkout: `python -m tools.gpu_selftest`, `tools/refresh_pins.py`."""
