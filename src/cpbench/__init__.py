"""cpbench: one benchmark driver for context-parallel attention."""

__version__ = "0.1.0"
