"""Tests of `DTypePolicyMap` (`jmp_policy/_src/policy_map/`).

A package, so that its modules may share basenames with those beside the core's tests.
"""
