"""graphddp's version, in one place: the package, the debug dump and the build (pyproject's dynamic version) read it.
Imports nothing, so every layer may read it."""

__version__ = "0.1.0"
