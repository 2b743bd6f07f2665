"""The daemon: FastAPI app, auth, settings."""
