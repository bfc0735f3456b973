"""Pooling (embeddings): what a request asks for and which runner a server is (no torch), and the
engine's pooler that turns hidden rows into embeddings (torch)."""
