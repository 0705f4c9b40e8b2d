"""`graphkiln serve`: an OpenAI-compatible HTTP server on one engine (`pip install 'graphkiln[serve]'`).

- `protocol`: the request bodies (pydantic) and the OpenAI-style errors;
- `loop`: the engine's own thread, fed by the HTTP handlers through a queue;
- `output`: what a client receives of its requests: text pieces, stop strings, logprobs;
- `responses`: the JSON shapes of completions, chat completions and their stream chunks;
- `metrics`: Prometheus metrics of one server;
- `app`: the FastAPI app (routes, API key, body limit, backpressure); `server`: uvicorn on a socket.

Only `graphkiln serve` and the tests import this package; the rest of graphkiln never does.
"""
