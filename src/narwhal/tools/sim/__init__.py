"""A vLLM-compatible engine simulator with a real KV handoff over a side channel."""
