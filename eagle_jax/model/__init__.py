"""The target model and its loading: config, plain ops, the Llama-family transformer with an
explicit KV cache, Hugging Face and GGUF checkpoints, the model registry and the tokenizer."""
