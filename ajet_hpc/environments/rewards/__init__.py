"""Reward helpers for agents, on top of libraries made for the job (each imported in the client group's
runtime only)."""
