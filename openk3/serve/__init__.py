"""Inference: cache.py (paged MLA cache, KDA states, the hybrid prefix cache), engine.py (the continuous-batching
engine, `openk3 generate` / `openk3 chat`), sampler.py (sampling and speculative acceptance), server.py (the
OpenAI-compatible HTTP server, `openk3 serve`). Nothing here imports openk3.train."""
