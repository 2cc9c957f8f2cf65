"""Benchmarks of elsa_vision: one module per benchmark, run from the repository root as
``python -m benchmarks.<name>``; the shared harness is :mod:`benchmarks.common`. What each one measures, its
current results (``benchmarks/results/``) and the command that produced them: ``docs/benchmarks.md``."""
