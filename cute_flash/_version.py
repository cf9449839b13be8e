"""The package version: the one place it is defined (pyproject.toml reads it at build time)."""

__version__ = "0.1.0"
