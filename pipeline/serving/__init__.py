"""What the serving engine (vLLM) accepts and how it maps an adapter: rules with their sources."""
