"""OpenAI-compatible HTTP server (`selfspec serve`): FastAPI routes -> EngineRunner thread -> Engine."""
