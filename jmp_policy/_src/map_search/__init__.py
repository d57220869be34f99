"""Searching a policy map: one format per layer under a budget, by measured sensitivity.

A private package, one module per concept:

* ``_candidates``: the candidates (the base policy and quantized ones) and what a layer's
  kernel costs under each;
* ``_taps``: the taps (an extension of the one per-submodule hook) that record each layer's
  output and weigh its error by the loss's gradient, also inside scans, remats and vmaps;
* ``_passes``: the passes in their order (gradients, then one per candidate) and their
  compiled forms kept across calls;
* ``_choice``: the choice under a budget (a multiple-choice knapsack,
  :mod:`jmp_policy._src.map_choice`) and what a search returns, ``SearchResult``;
* ``_compaction``: the map's entries, runs of numbered paths compacted to one key.

The Linen and NNX glue supply the runs.
"""

from jmp_policy._src.map_search._candidates import DEFAULT_CANDIDATES as DEFAULT_CANDIDATES
from jmp_policy._src.map_search._candidates import stores_weights as stores_weights
from jmp_policy._src.map_search._choice import BUDGETS as BUDGETS
from jmp_policy._src.map_search._choice import LayerRow as LayerRow
from jmp_policy._src.map_search._choice import SearchResult as SearchResult
from jmp_policy._src.map_search._compaction import compact as compact
from jmp_policy._src.map_search._passes import MAX_COMPILED as MAX_COMPILED
from jmp_policy._src.map_search._passes import search as search
from jmp_policy._src.map_search._taps import ScoreTaps as ScoreTaps

__all__ = [
    "BUDGETS",
    "DEFAULT_CANDIDATES",
    "MAX_COMPILED",
    "LayerRow",
    "ScoreTaps",
    "SearchResult",
    "compact",
    "search",
    "stores_weights",
]
