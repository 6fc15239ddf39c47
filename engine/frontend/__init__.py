"""The front end: ``LLM`` and ``AsyncEngine``, which turn engine outputs into text, deltas and statistics."""
