"""The package's one version (pyproject.toml's), in a module that imports nothing: ``attnc`` and
``attnc.compiler`` both read it here, so the compiler never imports the ``attnc`` package's
``__init__`` (whose lazy attributes reach the API and the backends)."""
__version__ = "0.2.0"
