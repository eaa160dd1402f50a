"""Model frontends: other model formats converted to quantopt's float graph (optional dependencies, lazy)."""
