"""Tests of the diagnostics package (`jmp_policy/_src/diagnostics/`).

A package, so that its modules may share basenames with those beside the core's tests.
"""
