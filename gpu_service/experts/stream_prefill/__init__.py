"""Prefill through the GPU: a long chunk's routed experts computed on the GPU from the workers'
packed weights, streamed over PCIe layer by layer (see backend.py for the whole path)."""
