"""homespec: a local LLM inference daemon with exact, self-tuning speculative decoding."""

__version__ = "0.1.0"
