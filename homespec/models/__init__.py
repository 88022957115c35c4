"""Models on disk and in memory: the registry of pullable models, fetching and verifying them,
loading a model set, and planning and watching the memory it needs. Knows nothing of the step."""
