"""The engine's actors: thin loops over an inbox that call the pure logic in llmserve.core."""
