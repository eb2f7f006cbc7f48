"""Benchmarks of the project, each a module run from the repository root as ``python -m benchmarks.NAME``
(``torchrun ... -m benchmarks.NAME`` for several processes); shell drivers call them the same way. Shared helpers
live in ``benchmarks.common``. What each one measures, and the current numbers: ``benchmarks/README.md``."""
