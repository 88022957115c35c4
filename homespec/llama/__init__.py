"""The only package that touches llama_cpp: runtimes (batches, sequences, truncation, hidden
states), saved KV states for prefix reuse, GGUF metadata and the model's chat template."""
