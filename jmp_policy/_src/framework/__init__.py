"""The framework adapter protocol, and the entry points written once against it.

A framework (Equinox today; Flax Linen and NNX keep their own glue until they are ported)
is an :class:`~jmp_policy._src.framework.protocol.Adapter`: it lists its modules and
layers, runs the model through the one hook (:mod:`jmp_policy._src.interception`), calls a
layer with an installed matmul, and rebuilds a model with new kernels. ``apply``,
``quantize`` and ``explain`` are written here once, for every adapter. Nothing here
imports a framework.
"""
