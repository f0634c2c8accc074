"""The HTTP front: the aiohttp app and routes, the serving handler, body limits, TLS, sockets, workers."""
