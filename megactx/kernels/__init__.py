"""Triton kernels for IndexShare sparse attention; `reference` holds their pure-PyTorch twins."""
