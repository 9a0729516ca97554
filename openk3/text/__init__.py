"""Text in and out of the model: tokenizer.py (Kimi's tiktoken tokenizer and the BPE trained for small runs)."""
