"""Loads: leased blocks from the daemon into vLLM's paged KV cache (worker role; torch).

Modules, one concept each:

  timings   LoadTimings, the phases of the last step's loads (observation only)
  step      one step's loads (FetchedLoad, StepLoads) and their results (LoadResults)
  copy_in   BlockLoader: fetched blocks copied into the KV cache and checked there
  fetch     Fetcher: each load's lease and arena views (or its blocks streamed)
  stream    a lease streamed into the KV cache, where the arena is not mapped
  strategy  LoadStrategy: where a step's copies and checks run
  inline, halves, beside   its three implementations
  choice    choose_load_strategy: the one a worker uses, picked at start-up
"""
