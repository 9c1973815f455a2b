"""`ktserve plan MODEL`: the memory plan `serve` would make, from a config alone (nothing loaded):
the GPU part's tensors by shape (gpu_tensors.py), their bytes per format and the KV cache's per
token (sizes.py), the parts and whether they fit (memory.py), the decode speed the DRAM rate
bounds (decode.py), and the report (report.py). docs/plan.md."""
