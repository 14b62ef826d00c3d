"""The package version, in a module of its own: any module can read it without importing the package."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
