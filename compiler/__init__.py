"""attnc: a compiler for attention mask programs (see DESIGN.md)."""

from attnc.version import __version__  # noqa: F401  (one version, the package's)
