"""The OpenAI-compatible server (`edge0-eval serve`, serve.py): the engine loads once and runs on
one thread that owns the batch (worker.py); the HTTP side (app.py, aiohttp) parses and validates
requests (requests.py) and relays answers."""
