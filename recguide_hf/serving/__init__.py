"""Serving: RecGuide's continuous batching behind a thread (`worker.py`), and an OpenAI-compatible HTTP server
over it (`app.py`, `recguide serve`; needs the `serve` extra: FastAPI and uvicorn)."""
