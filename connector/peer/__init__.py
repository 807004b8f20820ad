"""Same-host peers: an engine loads a prefix straight from another engine's KV cache.

  share    the holder's KV cache moved into shared memory, and its descriptor
  gens     per-block generations: bumped before vLLM reuses a block, checked
           around a peer's copy
  holder   the worker registers its cache with the daemon and publishes
           which key each filled block holds
  sched    the scheduler bumps generations (BlockPool.get_new_blocks) and asks
           the daemon for a peer's longer hit
  source   a peer's blocks copied in, layer by layer, checked by generations
  worker   the worker's peer side, built at register_kv_caches
  cuda_ipc the same handles for a KV cache on a GPU (CUDA IPC), for tests/gpu

The daemon's side is kvkeeper.server.peer; the socket, client.peer.
Off unless kvkeeper_peer is true (it moves the KV cache into /dev/shm).
"""
