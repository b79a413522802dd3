"""Stored Responses API responses: the conversations the router keeps for its clients."""
