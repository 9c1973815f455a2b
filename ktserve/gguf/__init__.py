"""GGUF checkpoints as users have them (one file, a split set, or a directory of either), each
module one job: files (where the files are), container (open, memory-map and validate before
anything loads), config (config.json from the `<arch>.*` metadata), names and tensors (tensors
under the Hugging Face names the families load, dequantized as read), tokenizer (tokenizer and
chat template from the metadata), errors. docs/gguf.md says what is served.

Nothing is imported here: `ktserve --help` and the CLI's checks import ktserve.gguf.files alone.
"""
