"""What crosses the disk: Hugging Face targets, DeepSpec-format drafters, safetensors I/O, the
tokenizer with its chat rendering, prompt and training records."""
