"""Talking to engines: the pooled client and the prefill result it hands to decode."""
