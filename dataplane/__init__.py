"""kvroute data-plane proxy: OpenAI-compatible, scores replicas locally, streams responses."""
