"""The single source of the package version (read by pyproject and `quantopt --version`)."""
__version__ = "0.1.0"
