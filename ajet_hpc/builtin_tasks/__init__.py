"""Built-in task sources (``tasks: builtin:<name>``): generated locally, nothing to download."""
