"""The OpenAI-compatible HTTP and WebSocket server: a thin layer over Engine.generate."""
