"""The web pages `pagellm serve` ships: a chat at / and a live KV-cache dashboard at /dashboard (see routes.py)."""
