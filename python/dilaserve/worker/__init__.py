"""The worker: executes denoising steps it is given, holding per-request state and KV cache."""
