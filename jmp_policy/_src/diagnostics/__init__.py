"""Diagnostics: what a model run does, per submodule and per dtype.

A private package, one module per concept; none knows Flax:

* ``taps``: the statistics taps (an extension of the per-submodule hook) and their probe;
* ``stats``: the statistics of a tensor; ``report``: the :class:`Report` pytree they fill;
* ``tap_selection``: which submodules are tapped, and how often;
* ``table``: a report as a table (``format_report``);
* ``dtype_profile``: the matmul FLOPs and bytes a function runs per dtype, from its jaxpr.

The package hands on what the glue's ``diagnose`` wrappers read.
"""

from jmp_policy._src.diagnostics.report import PathInfo as PathInfo
from jmp_policy._src.diagnostics.report import Report as Report
from jmp_policy._src.diagnostics.tap_selection import selection as selection
from jmp_policy._src.diagnostics.taps import Taps as Taps
from jmp_policy._src.diagnostics.taps import collecting as collecting

__all__ = ["PathInfo", "Report", "Taps", "collecting", "selection"]
