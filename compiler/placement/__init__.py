"""The pieces of L2's placement search, run by `harts.compiler.passes.place_windows`.

Internal to that pass (its module docstring describes the search and the
choices behind it); import the pass, not these modules.

* `options`: `L2Options`, the cost weights and search bounds.
* `evaluation`: exact rows and costs of an assignment of consumers to cells.
* `scoring`: a candidate `Layout`, its slot and replica order and its key.
* `packing`: repacking a cell's trajectories from intact subtrees.
* `candidates`: the starting placements.
* `refine`: depth adjustments and local moves of trajectories.
* `exchange`: whole consumers trading replicas.
* `verify`: every L2 invariant, recomputed independently.
"""
