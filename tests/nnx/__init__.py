"""Tests of `jmp_policy.nnx` alone; the rules it shares with Linen are tested in `tests/linen/`.

A package, so that its modules may share basenames with those beside the core's tests.
"""
