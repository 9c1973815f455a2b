"""The layers the families are built from: Linear in each GPU weight format (linear,
weight_formats, weight_only_triton), its tensor-parallel variants (sharding, parallel), norms
and the dense MLP (blocks), rotary embeddings (rope), the fused kernels (fused_ops) and the MoE
block that hands routed experts to gpu_service/experts (moe)."""
