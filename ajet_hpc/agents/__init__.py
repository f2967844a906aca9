"""Built-in agents: plain functions that use the openai client against the base_url they are given."""
