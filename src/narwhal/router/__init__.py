"""The HTTP router: admission, placement, the request path, relay and outcome."""
