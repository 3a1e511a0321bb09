"""Benchmarks for redis-locks-async against the peers a user would pick instead (SPEC §5).

Run ``python -m benchmarks [--quick]``; see ``benchmarks/README.md``. Importing this package has
no side effects (worker processes import its modules under the ``spawn`` start method).
"""
