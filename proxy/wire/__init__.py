"""The wire contract with clients and workers: request models, validation errors in vLLM's shape, ids,
body shapes. No I/O; every other layer may import it."""
