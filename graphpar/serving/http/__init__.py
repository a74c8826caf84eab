"""`graphpar serve`: an OpenAI-compatible HTTP server over the serving engine (FastAPI on
uvicorn): the request and response shapes (`protocol`), Prometheus metrics (`metrics`), the
routes and the runner (`app`)."""
