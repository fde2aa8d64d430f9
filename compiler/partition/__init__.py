"""L1's search, one job per module; `harts.compiler.passes.partition_microbatches` runs it."""
