"""Attention over the paged KV cache: GQA (gqa), the paged reference and dispatch
(paged_attention), the Triton kernels (attention_triton), MLA's decode on Hopper
(mla_decode_hopper, mla_decode_flashmla) and prefill (mla_prefill)."""
