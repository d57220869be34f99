"""Tests of the quantization package (`jmp_policy/_src/quantization/`).

A package, so that its modules may share basenames with those beside the core's tests.
"""
