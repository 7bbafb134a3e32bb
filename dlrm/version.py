"""The package's version, in one place: ``pyproject.toml`` reads it from here (setuptools'
``attr``), ``dlrm.__version__`` re-exports it, and CHANGELOG.md says what changed. A module of
its own so that reading it imports nothing else of the package."""

__version__ = "0.2.0.dev0"
