"""Serving: settings, the engine and its pipeline, documents (images, PDFs), telemetry, the uvicorn runner, Ray Serve and bulk jobs."""
