"""The resident trainer: server.py is the long-lived process, client.py the steps' side of it."""
