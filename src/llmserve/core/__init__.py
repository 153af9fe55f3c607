"""Pure scheduling and KV-cache logic: synchronous, no event loop, no device."""
