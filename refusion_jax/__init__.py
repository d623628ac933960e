"""ReFusion in JAX/Flax: training, decoding, evaluation and serving (see the README)."""

__version__ = "0.1.0"  # pyproject.toml reads the package's version from here
