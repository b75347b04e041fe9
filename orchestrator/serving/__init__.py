"""Serving: the OpenAI API (pure protocol, FastAPI app) on Ray Serve (``orchestrate serve``)."""
