"""Narwhal: an OpenAI-compatible router for disaggregated prefill/decode vLLM fleets."""

__version__ = "0.1.0"
