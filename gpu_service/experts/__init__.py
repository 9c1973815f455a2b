"""Everything that carries a step's routed-expert work: the shared-memory client of the CPU
workers (moe_client), the decode graph's own calls to them and their Triton kernels
(device_calls, device_kernels), hot experts on the GPU (gpu_experts) and prefill chunks whose
experts stream to the GPU (stream_prefill/)."""
