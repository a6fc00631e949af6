"""The OpenAI-compatible HTTP front end (FastAPI + uvicorn), a client of the engine like any other."""
