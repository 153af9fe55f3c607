"""Triton kernels and their plain-torch references: the shared paged-attention core."""
