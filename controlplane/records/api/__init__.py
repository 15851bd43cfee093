"""The admin REST API (FastAPI): JSON under ``/v1``, OpenAPI at ``/docs``."""
