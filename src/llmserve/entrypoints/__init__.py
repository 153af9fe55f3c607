"""User-facing ways in: the offline LLM class (and later the HTTP server)."""
