"""attnc: a compiler for attention mask programs (see DESIGN.md)."""

__version__ = "0.1.0"
