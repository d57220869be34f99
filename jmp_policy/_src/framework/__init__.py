"""The framework adapter protocol, and the entry points written once against it.

A framework (Flax Linen, NNX and Equinox) is an
:class:`~jmp_policy._src.framework.protocol.Adapter`: it lists its modules and layers,
runs the model through the one hook (:mod:`jmp_policy._src.interception`), calls a layer
with the matmul the core routes to it (or installs it, :class:`Routing`), and rebuilds a
model with new weights. ``apply``, ``quantize``, ``explain``, ``diagnose``, ``calibrate``
and ``search_map`` are written here once, for every adapter. Nothing here imports a
framework.
"""
