"""Training of ktserve's embedded demo model (demo_model/): corpus, tokenizer, model, perplexity."""
