"""A small draft model (distilled from the target, or any model sharing its tokenizer) and self-draft."""
