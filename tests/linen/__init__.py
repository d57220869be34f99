"""Tests of `jmp_policy.linen`, and of the Flax rules Linen and NNX share, checked in both.

A package, so that its modules may share basenames with those beside the core's tests.
"""
