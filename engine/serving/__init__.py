"""Real serving engines run beside this app's own engine (today: llama.cpp's ``llama-server``)."""
