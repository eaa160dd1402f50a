"""Operator family module (see quantopt/ops/__init__.py)."""
