"""Streamlit shell of Speedup Lab: entry point, page registry, shared UI state."""
