"""The frontend: tokenizer, chat template and typed frontend settings of a core."""
