"""Small helpers shared by every layer (no heavy imports here)."""
