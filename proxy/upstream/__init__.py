"""The hop client: one HTTP/1.1 exchange with a worker, its answer read within limits."""
