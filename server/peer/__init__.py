"""Same-host peer handles: engines' KV cache memory, registered as file
descriptors on the peer socket (service.py), and what each holds
(registry.py). The daemon holds the descriptors per session and never
copies KV: a peer engine maps the holder's cache and copies the blocks
itself (kvkeeper.connector.peer)."""
