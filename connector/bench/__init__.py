"""kvkeeper.connector.bench: the vLLM benchmarks of the connector.

`kvkeeper bench ttft` and `kvkeeper bench stream-hit` (the daemon's
`kvkeeper bench` finds them here by module name: kvkeeper.server.bench.registry)
start a kvkeeper daemon and vLLM engines with the connector, and measure time
to first token side by side. This package imports neither vLLM nor torch:
they are imported only in the engine processes (engine.py, and the timed
connectors vLLM loads there). Modules, one concept each:

  ttft_bench        the ttft benchmark: recompute, kvkeeper, ExampleConnector and
                    vLLM's own prefix cache (the floor), per model of the matrix
  ttft_matrix       its models, prompt lengths, counts and expected hits
  ttft_results      the results of one case (model, length) and their targets
  stream_hit_bench  a full hit over gRPC streams against one over shared memory
  rig               a daemon and named engines, and the pauses between requests
  driver            the parent's side of an engine process (also the connector tests')
  engine            one vLLM engine, driven one JSON line at a time (vLLM)
  ttft_connector    the connectors with timing lines (vLLM, torch)
  model             the dummy-weight model and random prompts
  phases            a request's time per phase, from the timing lines
  verify            the checks that every measured hit really happened
"""
