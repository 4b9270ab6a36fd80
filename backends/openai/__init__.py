"""The ``openai`` backend: models served by remote OpenAI-compatible endpoints (backend.py, fleet.py)."""
