"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine; see api_server.py."""
