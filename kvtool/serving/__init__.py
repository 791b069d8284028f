"""Serving model: engines, batching, shared links, routers and the cluster file (issue 19)."""
