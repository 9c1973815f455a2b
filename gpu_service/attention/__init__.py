"""Attention over the paged KV cache: the backend chosen at load that picks each call's kernel
(backend), GQA (gqa), the paged reference (paged_attention), the Triton kernels
(attention_triton), MLA's decode on Hopper (mla_decode_hopper, mla_decode_flashmla) and prefill
(mla_prefill)."""
