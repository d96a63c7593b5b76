"""The pure core shared by every decoding loop (generate, the engine, training and online)."""
