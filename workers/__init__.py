"""What runs behind the proxy: real vLLM workers (``launcher``, ``demo``), the tiny model, pd-sim."""
