"""The engine as its callers see it: the EngineClient protocol and its three clients (in-thread,
engine process, data-parallel). They take token ids: the server tokenizes (server/tokenization.py).
No module here imports torch (the frontend runs them with torch blocked; the in-thread client
loads the core when it starts)."""
