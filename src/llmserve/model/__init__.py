"""Model definitions, weight loading, the sampler and the model runner."""
