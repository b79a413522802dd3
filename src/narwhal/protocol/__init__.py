"""Pure wire-protocol pieces: SSE decoding, descriptor rules, request bodies, errors."""
